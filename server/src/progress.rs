//! Progress of long capture work (the baseline, ADR 0011) for an operator:
//! a bar redrawn in place on a terminal, and the same figures in `/ready`.

use std::io::{IsTerminal, Write};
use std::time::Duration;

use actors::Engine;
use actors::materializer::{BaselineProgress, CaptureStatus};
use protocol::json::{self, Value};

/// Cells of the bar.
const WIDTH: usize = 30;

/// One line: the bar, rows staged of all, the rate and the time left.
pub fn line(p: &BaselineProgress) -> String {
    let done = if p.total == 0 {
        WIDTH
    } else {
        (p.staged.min(p.total) as u128 * WIDTH as u128 / p.total as u128) as usize
    };
    let left = match p.seconds_left() {
        Some(s) => format!("{s} s left"),
        None => "time left unknown".to_owned(),
    };
    format!(
        "baseline [{}{}] {} of {} rows, {} rows/s, {left}",
        "#".repeat(done),
        "-".repeat(WIDTH - done),
        p.staged,
        p.total,
        p.rate
    )
}

/// The baseline's figures as a JSON object, for the operator status.
pub fn json(p: &BaselineProgress) -> Value {
    let mut o = json::Object::new();
    o.insert("staged".into(), Value::int(p.staged as i64));
    o.insert("total".into(), Value::int(p.total as i64));
    o.insert("rows_per_second".into(), Value::int(p.rate as i64));
    if let Some(s) = p.seconds_left() {
        o.insert("seconds_left".into(), Value::int(s as i64));
    }
    Value::Object(o)
}

/// On a terminal, draws the baseline's bar while one runs (the
/// materializer logs the same figures as lines otherwise).
pub fn draw_on_terminal(engine: Engine) {
    if !std::io::stderr().is_terminal() {
        return;
    }
    tokio::spawn(async move {
        let mut drawn = false;
        loop {
            tokio::time::sleep(Duration::from_millis(500)).await;
            let mut err = std::io::stderr();
            match engine.capture_status() {
                CaptureStatus::Baseline(p) => {
                    let _ = write!(err, "\r{}\x1b[K", line(&p));
                    drawn = true;
                }
                _ if drawn => {
                    let _ = writeln!(err, "\rbaseline: done\x1b[K");
                    drawn = false;
                }
                _ => {}
            }
            let _ = err.flush();
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_line_shows_the_share_done_the_rate_and_the_time_left() {
        let p = BaselineProgress {
            staged: 250,
            total: 1000,
            rate: 50,
        };
        assert_eq!(
            line(&p),
            "baseline [#######-----------------------] 250 of 1000 rows, 50 rows/s, 15 s left"
        );
        let fresh = BaselineProgress {
            staged: 0,
            total: 0,
            rate: 0,
        };
        assert!(line(&fresh).ends_with("time left unknown"));
        assert_eq!(
            json::to_canonical_string(&json(&p)),
            r#"{"rows_per_second":50,"seconds_left":15,"staged":250,"total":1000}"#
        );
    }
}
