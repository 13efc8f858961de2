//! WAL capture on a throwaway cluster: the capture suite (the same writes
//! and expected effects as MemStore), TRUNCATE blocking, and the key guard.
#![cfg(not(madsim))]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly

use actors::capture::CaptureProblem;
use actors::materializer::CaptureStatus;
use actors::store::{Store, StoreTx};
use actors::testkit::{
    CaptureWorld, HandOver, Write, capture_suite, fast_config, invalid_owners, repair_resumes,
    truncate_blocks, without_templates,
};
use protocol::position::Boundary;
use store_pg::cluster::PgCluster;
use store_pg::{PgStore, PgWorld as Pg, example_store};

#[tokio::test]
async fn capture_on_postgres() {
    let _ = tracing_subscriber::fmt().with_test_writer().try_init();
    let cluster = PgCluster::temp().unwrap();
    let world = Pg {
        store: example_store(&cluster, "capture").await,
    };
    capture_suite(&world).await;

    // The deletion fence: a hard-deleted row keeps its version row.
    let (deleted,): (bool,) = sqlx::query_as(
        "SELECT deleted FROM synchro.row_versions WHERE table_id = 'tbl_notes' \
         AND key = '00000000-0000-4000-8000-000000000002'",
    )
    .fetch_one(world.store.pool())
    .await
    .unwrap();
    assert!(deleted);

    // The key guard: a synced row's primary key never changes.
    let err = sqlx::raw_sql(
        "UPDATE public.notes SET id = '00000000-0000-4000-8000-0000000000ff' \
         WHERE id = '00000000-0000-4000-8000-000000000001'",
    )
    .execute(world.store.pool())
    .await
    .unwrap_err();
    assert!(
        err.to_string()
            .contains("primary key of a synced row cannot change")
    );

    let truncated = Pg {
        store: example_store(&cluster, "truncate").await,
    };
    truncate_blocks(&truncated).await;

    // The capture-state primitives, as on MemStore.
    actors::testkit::capture_store_suite(&example_store(&cluster, "conformance").await).await;

    for (i, owner) in invalid_owners().iter().enumerate() {
        let repaired = Pg {
            store: example_store(&cluster, &format!("repair_{i}")).await,
        };
        repair_resumes(&repaired, owner).await;
    }
}

/// A fresh example database with an engine whose capture runs.
async fn running_engine(cluster: &PgCluster, db: &str) -> (PgStore, actors::Engine) {
    let store = example_store(cluster, db).await;
    let engine = actors::Engine::start(store.clone(), fast_config(|s| s))
        .await
        .unwrap();
    wait_status(
        &engine,
        |s| matches!(s, CaptureStatus::Running { .. }),
        "running",
    )
    .await;
    (store, engine)
}

async fn wait_status(engine: &actors::Engine, want: fn(&CaptureStatus) -> bool, what: &str) {
    for _ in 0..1000 {
        if want(&engine.capture_status()) {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    panic!("capture never became {what}: {:?}", engine.capture_status());
}

/// Two processes on one database: one leads capture, the other stands by
/// and takes over when the leader goes away.
#[tokio::test]
async fn a_standby_takes_over_capture() {
    let cluster = PgCluster::temp().unwrap();
    let first = example_store(&cluster, "standby").await;
    let second = PgStore::connect(cluster.connect_options("standby"))
        .await
        .unwrap();
    let leader = actors::Engine::start(first.clone(), fast_config(|s| s))
        .await
        .unwrap();
    wait_status(
        &leader,
        |s| matches!(s, CaptureStatus::Running { .. }),
        "running",
    )
    .await;
    let standby = actors::Engine::start(second.clone(), fast_config(|s| s))
        .await
        .unwrap();
    wait_status(&standby, |s| *s == CaptureStatus::Standby, "standby").await;
    // A standby serves requests: it judges capture by the leader's durable
    // heartbeat, so it is ready while the leader keeps up.
    let mut ready = false;
    for _ in 0..400 {
        ready = standby.ready().await;
        if ready {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    assert!(ready, "a standby is ready while the leader keeps up");

    drop(leader);
    wait_status(
        &standby,
        |s| matches!(s, CaptureStatus::Running { .. }),
        "running",
    )
    .await;
    let world = Pg { store: second };
    let lsn = world
        .write(&[Write::Insert(
            "public.templates",
            &[("id", Some("t")), ("name", Some("n")), ("body", Some("b"))],
        )])
        .await;
    for _ in 0..1000 {
        let mut tx = world.store.begin().await.unwrap();
        let p = tx.capture_progress().await.unwrap();
        drop(tx);
        if matches!(p.boundary, Boundary::TransactionEnd { commit_lsn } if commit_lsn >= lsn) {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    panic!("the new leader did not materialize");
}

/// A renamed registered relation is drift: capture blocks on the first
/// transaction that shows it, and readiness turns false.
#[tokio::test]
async fn relation_drift_blocks_capture() {
    let cluster = PgCluster::temp().unwrap();
    let (store, engine) = running_engine(&cluster, "drift").await;
    sqlx::raw_sql(
        "ALTER TABLE public.templates RENAME TO templates_old; \
         INSERT INTO public.templates_old (id, name, body) VALUES ('t', 'n', 'b');",
    )
    .execute(store.pool())
    .await
    .unwrap();
    wait_status(
        &engine,
        |s| *s == CaptureStatus::Blocked(CaptureProblem::RelationDrift),
        "blocked by drift",
    )
    .await;
    assert!(!engine.ready().await);
    let mut tx = store.begin().await.unwrap();
    let q = tx.capture_progress().await.unwrap().quarantine.unwrap();
    assert_eq!(q.problem, CaptureProblem::RelationDrift);
}

/// A registered table dropped and recreated stops reaching the WAL stream:
/// the running materializer notices while idle and blocks, and a restart
/// refuses to install capture over the new table.
#[tokio::test]
async fn drop_and_recreate_blocks_capture() {
    let cluster = PgCluster::temp().unwrap();
    let (store, engine) = running_engine(&cluster, "recreate").await;
    sqlx::raw_sql(
        "DROP TABLE public.templates; \
         CREATE TABLE public.templates (id text PRIMARY KEY, name text NOT NULL, body text NOT NULL);",
    )
    .execute(store.pool())
    .await
    .unwrap();
    wait_status(
        &engine,
        |s| *s == CaptureStatus::Blocked(CaptureProblem::RelationDrift),
        "blocked by drift",
    )
    .await;
    assert!(!engine.ready().await);
    drop(engine);

    let again = PgStore::connect(cluster.connect_options("recreate"))
        .await
        .unwrap();
    let refused = actors::Engine::start(again, fast_config(|s| s)).await;
    let message = refused
        .err()
        .expect("capture refuses a recreated table")
        .to_string();
    assert!(
        message.contains("public.templates was dropped and recreated"),
        "{message}"
    );
}

/// A capture trigger disabled by hand would stop versions and notes: capture blocks.
#[tokio::test]
async fn a_disabled_trigger_blocks_capture() {
    let cluster = PgCluster::temp().unwrap();
    let (store, engine) = running_engine(&cluster, "disabled").await;
    sqlx::raw_sql("ALTER TABLE public.notes DISABLE TRIGGER synchro_version")
        .execute(store.pool())
        .await
        .unwrap();
    wait_status(
        &engine,
        |s| *s == CaptureStatus::Blocked(CaptureProblem::CaptureDisabled),
        "blocked: trigger disabled",
    )
    .await;
}

/// A slot dropped by hand blocks capture (the shared suite), is not created
/// again by a restart, and a slot created again by hand under its name is
/// not taken for the stream's: its position passed what was materialized.
#[tokio::test]
async fn a_lost_slot_blocks_capture_on_postgres() {
    let cluster = PgCluster::temp().unwrap();
    let world = Pg {
        store: example_store(&cluster, "slot_loss").await,
    };
    actors::testkit::slot_loss_blocks(&world).await;
    let slots = || async {
        sqlx::query_scalar::<_, String>(
            "SELECT slot_name FROM pg_replication_slots WHERE database = current_database()",
        )
        .fetch_all(world.store.pool())
        .await
        .unwrap()
    };
    assert_eq!(slots().await, Vec::<String>::new(), "not created again");

    let slot: String = sqlx::query_scalar("SELECT slot_name FROM synchro.capture_slot")
        .fetch_one(world.store.pool())
        .await
        .unwrap();
    sqlx::query("SELECT pg_create_logical_replication_slot($1, 'pgoutput')")
        .bind(&slot)
        .execute(world.store.pool())
        .await
        .unwrap();
    let engine = actors::Engine::start(world.store.clone(), fast_config(|s| s))
        .await
        .unwrap();
    for _ in 0..1000 {
        if engine.capture_status() == CaptureStatus::Blocked(CaptureProblem::SlotLost) {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    assert_eq!(
        engine.capture_status(),
        CaptureStatus::Blocked(CaptureProblem::SlotLost),
        "a replaced slot is not the stream's"
    );
}

/// The shared baseline suite on PostgreSQL: the slot is created with an
/// exported snapshot and the existing rows are read under it.
#[tokio::test]
async fn existing_rows_arrive_as_the_baseline_on_postgres() {
    let cluster = PgCluster::temp().unwrap();
    let world = Pg {
        store: example_store(&cluster, "baseline").await,
    };
    actors::testkit::baseline_adopts_existing_rows(&world).await;
}

/// A baseline cut short after its first chunk (the shared suite, ADR
/// 0030): the slot is kept, and the rows not yet read are re-read.
#[tokio::test]
async fn a_baseline_cut_short_is_handed_over_on_postgres() {
    let cluster = PgCluster::temp().unwrap();
    for (name, how) in [
        ("cut_crash", HandOver::Crash),
        ("cut_limit", HandOver::SnapshotLimit),
    ] {
        let world = Pg {
            store: example_store(&cluster, name).await,
        };
        actors::testkit::baseline_cut_short_is_handed_over(&world, how).await;
    }
}

/// The operator stream reset on PostgreSQL (the shared suite): out of a
/// slot dropped by hand, and out of a TRUNCATE nothing can repair.
#[tokio::test]
async fn a_stream_reset_recovers_on_postgres() {
    let cluster = PgCluster::temp().unwrap();
    for (name, broken) in [
        ("reset_slot", actors::testkit::Broken::SlotLost),
        ("reset_poison", actors::testkit::Broken::Poisoned),
    ] {
        let world = Pg {
            store: example_store(&cluster, name).await,
        };
        actors::testkit::stream_reset_recovers(&world, broken).await;
    }
}

/// Issue 24's stuck fence, reproduced. PostgreSQL hands a commit to
/// logical decoding before the committing session leaves the proc array;
/// a synchronous standby that never answers holds a push's commit in that
/// state, so the materializer materializes it while its pending fence is
/// invisible. Once the commit is visible, the fence is not pending (ADR
/// 0014). The walsender does not always pick the held commit up in time,
/// so each attempt that it did not is released and another one made.
#[tokio::test]
async fn a_fence_decoded_before_it_is_visible_is_satisfied() {
    let cluster = PgCluster::temp().unwrap();
    let store = example_store(&cluster, "invisible").await;
    // No idle heartbeat may commit (and wait for the standby) meanwhile.
    let mut config = fast_config(|s| s);
    config.capture.heartbeat_ms = 3_000;
    let engine = actors::Engine::start(store.clone(), config).await.unwrap();
    wait_status(
        &engine,
        |s| matches!(s, CaptureStatus::Running { .. }),
        "running",
    )
    .await;
    let pool = store.pool();
    let mut reproduced = 0;
    for attempt in 0..8 {
        let key = format!("00000000-0000-4000-8000-0000000000f{attempt}");
        let client = format!("c-invisible-{attempt}");
        standby(pool, Some("nobody")).await;
        // The push: a client's write, whose commit waits for the standby.
        let pusher = pool.clone();
        let sql = format!(
            "BEGIN; SELECT set_config('synchro.client_id', '{client}', true); \
             INSERT INTO public.notes (id, owner_id, title, pinned, updated_at) \
             VALUES ('{key}', 'alice', 't', false, now()); COMMIT"
        );
        let push = tokio::spawn(async move {
            sqlx::raw_sql(&sql).execute(&pusher).await.unwrap();
        });
        // The materializer's group is open (it holds the progress row) and
        // waits at its commit too: it ran while the push was invisible.
        let mut held = false;
        for _ in 0..300 {
            if group_waits_behind_push(pool).await {
                held = true;
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        standby(pool, None).await;
        push.await.unwrap();
        reproduced += usize::from(held);
        // The row is materialized, and its fence is not pending: a pull by
        // the client would not answer capture_pending.
        for _ in 0..1000 {
            let done: bool = sqlx::query_scalar(
                "SELECT EXISTS (SELECT 1 FROM synchro.projections WHERE key = $1)",
            )
            .bind(&key)
            .fetch_one(pool)
            .await
            .unwrap();
            if done {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        let mut tx = store.begin().await.unwrap();
        assert!(
            tx.pending_fences(&client, 8).await.unwrap().is_empty(),
            "attempt {attempt}"
        );
        drop(tx);
        if reproduced > 0 {
            break;
        }
    }
    assert!(
        reproduced > 0,
        "no attempt materialized a push before it was visible"
    );
    // The leader reconciles each pair once both are visible.
    let mut left: (i64, i64) = (1, 1);
    for _ in 0..1000 {
        left = sqlx::query_as(
            "SELECT (SELECT count(*) FROM synchro.pending_fences), \
                    (SELECT count(*) FROM synchro.satisfied_fences)",
        )
        .fetch_one(pool)
        .await
        .unwrap();
        if left == (0, 0) {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    assert_eq!(left, (0, 0), "pending and satisfied fences reconciled");
}

/// Names a synchronous standby (that never answers), or none.
async fn standby(pool: &sqlx::PgPool, name: Option<&str>) {
    let set = match name {
        Some(n) => format!("ALTER SYSTEM SET synchronous_standby_names = '{n}'"),
        None => "ALTER SYSTEM RESET synchronous_standby_names".to_owned(),
    };
    for sql in [set.as_str(), "SELECT pg_reload_conf()"] {
        sqlx::raw_sql(sql).execute(pool).await.unwrap();
    }
}

/// Whether a materialization holds the progress row and both it and the
/// push wait for the standby at their commits.
async fn group_waits_behind_push(pool: &sqlx::PgPool) -> bool {
    let waiting: i64 =
        sqlx::query_scalar("SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'SyncRep'")
            .fetch_one(pool)
            .await
            .unwrap();
    if waiting < 2 {
        return false;
    }
    let mut probe = pool.begin().await.unwrap();
    sqlx::raw_sql("SET LOCAL synchronous_commit = local")
        .execute(&mut *probe)
        .await
        .unwrap();
    let locked = sqlx::raw_sql("SELECT 1 FROM synchro.capture_progress FOR UPDATE NOWAIT")
        .execute(&mut *probe)
        .await
        .is_err_and(|e| e.as_database_error().and_then(|d| d.code()).as_deref() == Some("55P03"));
    probe.rollback().await.unwrap();
    locked
}

/// Capture materializes through connections of its own: with every
/// connection of the requests' pool held (requests queued for one), a
/// source commit is still materialized.
#[tokio::test]
async fn capture_never_waits_for_a_request_connection() {
    let cluster = PgCluster::temp().unwrap();
    let (store, _engine) = running_engine(&cluster, "own_connections").await;
    let pool = store.pool();
    let mut held = Vec::new();
    while let Ok(Ok(c)) =
        tokio::time::timeout(std::time::Duration::from_millis(200), pool.acquire()).await
    {
        held.push(c);
    }
    assert_eq!(held.len() as u32, pool.options().get_max_connections());
    let mut source =
        <sqlx::PgConnection as sqlx::Connection>::connect(&cluster.url("own_connections"))
            .await
            .unwrap();
    let lsn: i64 = sqlx::query_scalar(
        "INSERT INTO public.notes (id, owner_id, title) \
         VALUES ('00000000-0000-4000-8000-0000000000e1', 'alice', 't') \
         RETURNING (pg_current_wal_insert_lsn() - '0/0')::int8",
    )
    .fetch_one(&mut source)
    .await
    .unwrap();
    let mut passed = false;
    for _ in 0..1000 {
        let end: i64 = sqlx::query_scalar("SELECT end_lsn FROM synchro.capture_progress")
            .fetch_one(&mut source)
            .await
            .unwrap();
        if end >= lsn {
            passed = true;
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    assert!(
        passed,
        "capture materialized the commit while every request connection was held"
    );
    drop(held);
}

/// A restart with a changed config rematerializes the relations whose
/// capture model changed, beside live writes, as on MemStore (ADR 0020).
#[tokio::test]
async fn a_config_change_rematerializes_its_relations_on_postgres() {
    let _ = tracing_subscriber::fmt().with_test_writer().try_init();
    let cluster = PgCluster::temp().unwrap();
    let world = Pg {
        store: example_store(&cluster, "evolution").await,
    };
    actors::testkit::rematerialization_suite(&world).await;
}

/// A DDL `ddl` under the running server that conflicts with the config:
/// capture blocks with `problem` at the first transaction after it (a note
/// written with `pinned`), and nothing after it is materialized; a restart
/// with the config edited by `follow` materializes that transaction and
/// goes on.
async fn conflicting_ddl_blocks_until_the_config_follows(
    db: &str,
    ddl: &str,
    pinned: &str,
    problem: CaptureProblem,
    follow: fn(String) -> String,
) {
    let _ = tracing_subscriber::fmt().with_test_writer().try_init();
    let cluster = PgCluster::temp().unwrap();
    let (store, engine) = running_engine(&cluster, db).await;
    sqlx::raw_sql(ddl).execute(store.pool()).await.unwrap();
    let world = Pg {
        store: store.clone(),
    };
    let note = [
        ("id", Some("00000000-0000-4000-8000-0000000000d1")),
        ("owner_id", Some("alice")),
        ("title", Some("t")),
        ("pinned", Some(pinned)),
        ("updated_at", Some("2026-07-18 14:00:01+00")),
    ];
    let lsn = world.write(&[Write::Insert("public.notes", &note)]).await;
    let p = actors::testkit::settle(&store, lsn).await;
    assert_eq!(p.quarantine.map(|q| q.problem), Some(problem.clone()));
    assert!(
        !matches!(p.boundary, Boundary::TransactionEnd { commit_lsn } if commit_lsn >= lsn),
        "nothing after the DDL was materialized"
    );
    wait_status(
        &engine,
        |s| matches!(s, CaptureStatus::Blocked(_)),
        "blocked",
    )
    .await;
    assert_eq!(engine.capture_status(), CaptureStatus::Blocked(problem));
    drop(engine);
    let _engine = actors::Engine::start(store.clone(), fast_config(follow))
        .await
        .unwrap();
    for _ in 0..1000 {
        let mut tx = store.begin().await.unwrap();
        let p = tx.capture_progress().await.unwrap();
        if matches!(p.boundary, Boundary::TransactionEnd { commit_lsn } if commit_lsn >= lsn) {
            assert_eq!(p.quarantine, None, "the transaction materialized");
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    panic!("capture did not resume");
}

/// The config line of field `field`.
fn field_line(config: &str, field: &str) -> String {
    config
        .lines()
        .find(|l| l.contains(field))
        .unwrap()
        .to_owned()
}

/// A column a field maps to, retyped under the running server to a type
/// its field cannot hold (`boolean` to `text`): `column_retyped` (not the
/// anonymous `invalid_value`) until the field's type follows the column.
#[tokio::test]
async fn a_retyped_synced_column_blocks_capture_until_the_config_follows() {
    conflicting_ddl_blocks_until_the_config_follows(
        "retyped_column",
        "ALTER TABLE public.notes ALTER COLUMN pinned DROP DEFAULT, \
         ALTER COLUMN pinned TYPE text USING pinned::text",
        "maybe",
        CaptureProblem::ColumnRetyped,
        |s| {
            let line = field_line(&s, "fld_notes_pinned");
            s.replace(&line, &line.replace("\"boolean\"", "\"string\""))
        },
    )
    .await;
}

/// A column a field maps to, dropped under the running server:
/// `column_missing` until the field is removed from the config.
#[tokio::test]
async fn a_dropped_synced_column_blocks_capture_until_the_config_follows() {
    conflicting_ddl_blocks_until_the_config_follows(
        "dropped_column",
        "ALTER TABLE public.notes DROP COLUMN body",
        "f",
        CaptureProblem::ColumnMissing,
        |s| {
            let line = field_line(&s, "fld_notes_body");
            s.replace(&format!("{line}\n"), "")
        },
    )
    .await;
}

/// Issue 25: an idle slot keeps little WAL. After a burst of source
/// writes, capture idles; its own heartbeats keep writing WAL that holds no
/// source transaction. Capture confirms that WAL, so the slot's confirmed
/// position passes the burst and, after a checkpoint, its restart position
/// (what PostgreSQL keeps WAL for) follows, with no source commit after.
#[tokio::test]
async fn an_idle_slot_lets_go_of_the_wal_after_a_burst() {
    let cluster = PgCluster::temp().unwrap();
    let (store, _engine) = running_engine(&cluster, "idle_slot").await;
    let pool = store.pool();
    for i in 0..50 {
        sqlx::query("INSERT INTO public.notes (owner_id, title) VALUES ('idle', $1)")
            .bind(format!("n{i}"))
            .execute(pool)
            .await
            .unwrap();
    }
    let lsn = |sql: &'static str| async move {
        sqlx::query_scalar::<_, Option<i64>>(sql)
            .fetch_one(pool)
            .await
            .unwrap()
            .unwrap_or(0)
    };
    let burst_end = lsn("SELECT (pg_current_wal_lsn() - '0/0'::pg_lsn)::bigint").await;
    let slot = |column: &'static str| {
        let sql = match column {
            "confirmed" => {
                "SELECT (confirmed_flush_lsn - '0/0'::pg_lsn)::bigint FROM pg_replication_slots \
                 WHERE database = current_database() AND slot_type = 'logical'"
            }
            _ => {
                "SELECT (restart_lsn - '0/0'::pg_lsn)::bigint FROM pg_replication_slots \
                 WHERE database = current_database() AND slot_type = 'logical'"
            }
        };
        lsn(sql)
    };
    let start = std::time::Instant::now();
    while slot("restart").await <= burst_end {
        assert!(
            start.elapsed() < std::time::Duration::from_secs(60),
            "an idle slot still holds the burst's WAL: confirmed {} restart {} burst end {burst_end}",
            slot("confirmed").await,
            slot("restart").await
        );
        // A checkpoint logs the running transactions the slot needs to move.
        sqlx::query("CHECKPOINT").execute(pool).await.unwrap();
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    }
    assert!(slot("confirmed").await > burst_end);
}

/// Whether the shared stream holds a quarantine.
async fn quarantined(store: &PgStore) -> Option<CaptureProblem> {
    let mut tx = store.begin().await.unwrap();
    let p = tx.capture_progress().await.unwrap();
    p.quarantine.map(|q| q.problem)
}

/// A rolling deploy that registers a table: the process still on the
/// older config sees the newer start's publication, and must take it for
/// a newer config (it gives way), not for drift that blocks the stream
/// the newer process is about to lead (ADR 0020).
#[tokio::test]
async fn an_older_process_gives_way_to_a_config_that_registers_a_table() {
    let _ = tracing_subscriber::fmt().with_test_writer().try_init();
    let cluster = PgCluster::temp().unwrap();
    let store = example_store(&cluster, "registers").await;
    let older = actors::Engine::start(store.clone(), fast_config(without_templates))
        .await
        .unwrap();
    wait_status(
        &older,
        |s| matches!(s, CaptureStatus::Running { .. }),
        "running",
    )
    .await;
    // Another process, with the config that registers templates.
    let own = PgStore::connect(cluster.connect_options("registers"))
        .await
        .unwrap();
    let newer = actors::Engine::start(own, fast_config(|s| s))
        .await
        .unwrap();
    wait_status(&older, |s| *s == CaptureStatus::Superseded, "superseded").await;
    wait_status(
        &newer,
        |s| matches!(s, CaptureStatus::Running { .. }),
        "the newer process leads",
    )
    .await;
    assert_eq!(quarantined(&store).await, None);
}

/// A write to the table a newer config registers reaches the older leader
/// first: it gives way, not a quarantine, as on MemStore (ADR 0020 §6).
#[tokio::test]
async fn an_older_leader_gives_way_on_postgres() {
    let _ = tracing_subscriber::fmt().with_test_writer().try_init();
    let cluster = PgCluster::temp().unwrap();
    let world = Pg {
        store: example_store(&cluster, "gives_way").await,
    };
    actors::testkit::an_older_leader_gives_way(&world).await;
}

/// Whether, within half a second, the installation check's lost-slot
/// query waits on a lock.
async fn check_waits(pool: &sqlx::PgPool) -> bool {
    for _ in 0..100 {
        let n: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' \
             AND query LIKE '%confirmed_flush_lsn%'",
        )
        .fetch_one(pool)
        .await
        .unwrap();
        if n > 0 {
            return true;
        }
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    false
}

/// The older process's installation check can run after the newer start
/// changed what is installed and after it read the records that would
/// have told it: its check sees a trigger the newer config dropped. It
/// must give way, not quarantine the stream the newer process leads. The
/// check is held on a lock until the newer start's two steps (its records,
/// then its installation) are done, as a slow machine interleaves them.
#[tokio::test]
async fn an_older_process_whose_check_sees_a_newer_installation_gives_way() {
    let _ = tracing_subscriber::fmt().with_test_writer().try_init();
    let cluster = PgCluster::temp().unwrap();
    let (store, older) = running_engine(&cluster, "interleaved").await;
    let pool = store.pool();
    // The older leader's next idle check waits on the lock, past its
    // reading of the records. Another step of its loop may be caught on
    // the lock instead (reading progress takes it too): then let go and
    // try again.
    let mut held = None;
    for _ in 0..50 {
        let mut lock = pool.begin().await.unwrap();
        sqlx::query("LOCK TABLE synchro.capture_slot IN ACCESS EXCLUSIVE MODE")
            .execute(&mut *lock)
            .await
            .unwrap();
        if check_waits(pool).await {
            held = Some(lock);
            break;
        }
        lock.rollback().await.unwrap();
    }
    let lock = held.expect("the older leader's check waits on the lock");
    // The newer start: its records, then its installation (templates no
    // longer registered lose their triggers).
    let newer = fast_config(without_templates);
    let mut tx = store.begin().await.unwrap();
    actors::stream::reconcile_rematerializations(&mut tx, &newer)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    sqlx::raw_sql(
        "DROP TRIGGER synchro_version ON public.templates; \
         DROP TRIGGER synchro_key_guard ON public.templates;",
    )
    .execute(pool)
    .await
    .unwrap();
    lock.commit().await.unwrap();
    wait_status(&older, |s| *s == CaptureStatus::Superseded, "superseded").await;
    assert_eq!(quarantined(&store).await, None);
}
