//! Crashes aimed at a point inside a server operation. Random crashes land
//! wherever the run happens to be; a tripwire makes sure the server also
//! dies exactly where the protocol is most fragile: with a rebuild's stage
//! written but not sealed, with a page built but not yet stored, or with a
//! baseline written but not committed. The
//! server reaches an armed point, the tripwire tells the crasher and parks
//! the operation, and the crasher kills the server there, before the
//! operation reaches the database. The open transaction is then rolled back
//! by the database, as PostgreSQL does when a connection dies.
//!
//! Each armed point fires once per run.

use std::collections::BTreeSet;
use std::sync::Mutex;

use tokio::sync::mpsc;

/// A point inside a server operation where the simulation can kill it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum CrashPoint {
    /// A new rebuild session's rows are staged; its digest is not yet read
    /// back, and the session is neither sealed nor committed.
    MidStaging,
    /// A rebuild's first page is built and about to be stored.
    FirstPage,
    /// A continued rebuild's page is built and about to be stored.
    LaterPage,
    /// Every chunk of the baseline is written; the transaction is about to
    /// record it complete and commit (ADR 0011).
    MidBaseline,
}

impl CrashPoint {
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
        if !self.armed.lock().expect("armed").remove(&point) {
            return;
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
