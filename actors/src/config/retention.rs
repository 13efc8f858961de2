//! `[retention]`: how long a client may stay away and still resume
//! incrementally, and how compaction paces itself (docs/adr/0024).

use std::time::Duration;

use serde::Deserialize;

/// The retention window and compaction's pace; every one finite.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct RetentionConfig {
    /// A client that acknowledges nothing for this long no longer holds
    /// the floor back; its scopes then rebuild (seconds; 30 days).
    #[serde(default = "default_window_seconds")]
    pub window_seconds: u64,
    /// How often the capture leader moves the floor and compacts (seconds).
    #[serde(default = "default_compact_interval_seconds")]
    pub compact_interval_seconds: u64,
    /// Effects deleted in one compaction transaction.
    #[serde(default = "default_compact_batch")]
    pub compact_batch: usize,
}

impl Default for RetentionConfig {
    fn default() -> Self {
        RetentionConfig {
            window_seconds: default_window_seconds(),
            compact_interval_seconds: default_compact_interval_seconds(),
            compact_batch: default_compact_batch(),
        }
    }
}

impl RetentionConfig {
    /// The window as a duration.
    pub fn window(&self) -> Duration {
        Duration::from_secs(self.window_seconds)
    }

    /// The pause between compaction passes.
    pub fn interval(&self) -> Duration {
        Duration::from_secs(self.compact_interval_seconds)
    }

    /// Refuses a value that would stop retention or make it unbounded.
    pub fn check(&self) -> Result<(), String> {
        if self.window_seconds == 0 || self.compact_interval_seconds == 0 {
            return Err(
                "[retention] window_seconds and compact_interval_seconds must be positive".into(),
            );
        }
        if !(1..=100_000).contains(&self.compact_batch) {
            return Err("[retention] compact_batch must be 1 to 100000".into());
        }
        Ok(())
    }
}

/// A month: a device used monthly resumes without a rebuild.
fn default_window_seconds() -> u64 {
    30 * 24 * 3600
}

fn default_compact_interval_seconds() -> u64 {
    60
}

fn default_compact_batch() -> usize {
    1_000
}
