//! Crashes aimed at a point inside a server operation. Random crashes land
//! wherever the run happens to be; a tripwire makes sure the server also
//! dies exactly where the protocol is most fragile: with a rebuild's stage
//! written but not sealed, with a page built but not yet stored, with a
//! baseline written but not committed, with a push's writes done but not
//! recorded, inside a pull, or with a group materialized but not
//! acknowledged to the slot. The
//! server reaches an armed point, the tripwire tells the crasher and parks
//! the operation, and the crasher kills the server there, before the
//! operation reaches the database. The open transaction is then rolled back
//! by the database, as PostgreSQL does when a connection dies.
//!
//! Each armed point fires once per run.

use std::collections::BTreeSet;
use std::sync::Mutex;

use madsim::rand::{Rng, thread_rng};
use tokio::sync::mpsc;

/// A point inside a server operation where the simulation can kill it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum CrashPoint {
    /// A new rebuild session's rows are staged; its digest is not yet read
    /// back, and the session is neither sealed nor committed.
    MidStaging,
    /// A rebuild's first page is about to be rendered from its stage.
    FirstPage,
    /// A continued rebuild's page is about to be rendered from its stage.
    LaterPage,
    /// The baseline's last chunk is written; its transaction is about to
    /// record the baseline complete and commit (ADR 0011).
    MidBaseline,
    /// A baseline chunk after the first is written, the chunks before it
    /// committed; its transaction is about to record it and commit, so
    /// the baseline is cut short and handed over to re-reads (ADR 0030).
    BaselineCutShort,
    /// A push's writes are done in its transaction; its ledger record is
    /// about to be written (and the whole transaction commits after it).
    MidPush,
    /// A pull's transaction is about to write the checkpoints of the
    /// cursors it was shown (the delayed acknowledgement).
    MidPull,
    /// The materializer committed a group; acknowledging its end to the
    /// slot is about to be sent.
    BeforeAcknowledge,
}

impl CrashPoint {
    /// Every point the whole system is crashed at (issue 14).
    pub const SYSTEM: [CrashPoint; 6] = [
        CrashPoint::MidStaging,
        CrashPoint::FirstPage,
        CrashPoint::LaterPage,
        CrashPoint::MidPush,
        CrashPoint::MidPull,
        CrashPoint::BeforeAcknowledge,
    ];

    /// Every point inside a rebuild.
    pub const REBUILD: [CrashPoint; 3] = [
        CrashPoint::MidStaging,
        CrashPoint::FirstPage,
        CrashPoint::LaterPage,
    ];
}

/// The armed points of one run, and the line to its crasher.
pub struct Tripwire {
    armed: Mutex<BTreeSet<CrashPoint>>,
    crasher: Mutex<Option<mpsc::UnboundedSender<CrashPoint>>>,
}

impl Tripwire {
    /// A tripwire with `points` armed; the receiver is the crasher's.
    pub fn arm(points: &[CrashPoint]) -> (Tripwire, mpsc::UnboundedReceiver<CrashPoint>) {
        let (tx, rx) = mpsc::unbounded_channel();
        let wire = Tripwire {
            armed: Mutex::new(points.iter().copied().collect()),
            crasher: Mutex::new(Some(tx)),
        };
        (wire, rx)
    }

    /// The server is at `point`. If it is armed, it is disarmed, the
    /// crasher is told, and this never returns: the server dies here.
    pub async fn reach(&self, point: CrashPoint) {
        {
            let mut armed = self.armed.lock().expect("armed");
            // A point every request passes fires at a random pass (one in
            // five), not always at the run's first.
            let frequent = matches!(
                point,
                CrashPoint::MidPush | CrashPoint::MidPull | CrashPoint::BeforeAcknowledge
            );
            if !armed.contains(&point) || (frequent && !thread_rng().gen_bool(0.2)) {
                return;
            }
            armed.remove(&point);
        }
        let told = self
            .crasher
            .lock()
            .expect("crasher")
            .as_ref()
            .is_some_and(|c| c.send(point).is_ok());
        if told {
            std::future::pending::<()>().await;
        }
    }

    /// Disarms every point and lets the crasher finish (quiescence).
    pub fn disarm(&self) {
        self.armed.lock().expect("armed").clear();
        self.crasher.lock().expect("crasher").take();
    }
}
