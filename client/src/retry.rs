//! The retry rules: a client retries only an answer marked `retryable`
//! (429, 503), after its `Retry-After` delay or, without one, an
//! exponential backoff, each with jitter so that clients refused together
//! do not return together.

use std::time::{Duration, SystemTime};

use rand_chacha::ChaCha8Rng;
use rand_chacha::rand_core::RngCore;

/// Reads a `Retry-After` value as the spec's receiver must: optional
/// whitespace removed, then delay-seconds (digits without a leading zero),
/// a fractional decimal (tolerated: digits, `.`, digits), or an HTTP date
/// (the delay from `now`, never negative). Exponents, signs, leading zeros
/// and missing digits are refused.
pub fn parse_retry_after(text: &str, now: SystemTime) -> Option<Duration> {
    let t = text.trim_matches([' ', '\t']);
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    let no_leading_zero = |s: &str| s == "0" || !s.starts_with('0');
    match t.split_once('.') {
        None if digits(t) && no_leading_zero(t) => t.parse().ok().map(Duration::from_secs),
        Some((whole, fraction)) if digits(whole) && no_leading_zero(whole) && digits(fraction) => t
            .parse::<f64>()
            .ok()
            .and_then(|s| Duration::try_from_secs_f64(s).ok()),
        None | Some(_) if t.bytes().any(|b| b.is_ascii_alphabetic()) => {
            let at = httpdate::parse_http_date(t).ok()?;
            Some(at.duration_since(now).unwrap_or(Duration::ZERO))
        }
        _ => None,
    }
}

/// How long to wait before the next try of one request.
#[derive(Clone, Debug)]
pub struct Backoff {
    attempt: u32,
    base: Duration,
    cap: Duration,
}

impl Backoff {
    /// A backoff from `base`, doubling per attempt up to `cap`.
    pub fn new(base: Duration, cap: Duration) -> Backoff {
        Backoff {
            attempt: 0,
            base,
            cap,
        }
    }

    /// Tries so far.
    pub fn attempts(&self) -> u32 {
        self.attempt
    }

    /// The next delay: the server's `Retry-After` (at most `cap`) plus up to
    /// a tenth more, or else a random delay in the upper half of the
    /// doubling window.
    pub fn next(&mut self, retry_after: Option<Duration>, rng: &mut ChaCha8Rng) -> Duration {
        self.attempt += 1;
        let jitter = |max: Duration, rng: &mut ChaCha8Rng| {
            let nanos = u64::try_from(max.as_nanos()).unwrap_or(u64::MAX);
            Duration::from_nanos(rng.next_u64() % nanos.saturating_add(1))
        };
        match retry_after {
            Some(d) => {
                let d = d.min(self.cap);
                d + jitter(d / 10, rng)
            }
            None => {
                let window = self
                    .base
                    .saturating_mul(1 << self.attempt.min(20))
                    .min(self.cap);
                window / 2 + jitter(window / 2, rng)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand_chacha::rand_core::SeedableRng;

    #[test]
    fn retry_after_values() {
        let now = httpdate::parse_http_date("Tue, 01 Dec 2026 12:00:00 GMT").unwrap();
        let p = |s: &str| parse_retry_after(s, now);
        assert_eq!(p("5"), Some(Duration::from_secs(5)));
        assert_eq!(p(" 0 "), Some(Duration::ZERO), "whitespace is removed");
        assert_eq!(p("\t120"), Some(Duration::from_secs(120)));
        assert_eq!(
            p("1.5"),
            Some(Duration::from_millis(1500)),
            "fractional is tolerated"
        );
        assert_eq!(p("0.25"), Some(Duration::from_millis(250)));
        assert_eq!(
            p("Tue, 01 Dec 2026 12:00:30 GMT"),
            Some(Duration::from_secs(30)),
            "an IMF-fixdate is a delay from now"
        );
        assert_eq!(
            p("Tue, 01 Dec 2026 11:00:00 GMT"),
            Some(Duration::ZERO),
            "a past date is now"
        );
        for refused in [
            "", " ", "-1", "+1", "05", "00.5", "1e3", "1.", ".5", "1.5.5", "1,5", "0x10", "five",
            "1 2",
        ] {
            assert_eq!(p(refused), None, "{refused:?} is refused");
        }
    }

    #[test]
    fn backoff_doubles_with_jitter_and_honours_retry_after() {
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        let mut b = Backoff::new(Duration::from_millis(100), Duration::from_secs(10));
        let mut windows = Vec::new();
        for _ in 0..10 {
            let d = b.next(None, &mut rng);
            let window = Duration::from_millis(100)
                .saturating_mul(1 << b.attempts())
                .min(Duration::from_secs(10));
            assert!(
                d >= window / 2 && d <= window,
                "{d:?} within its window {window:?}"
            );
            windows.push(window);
        }
        assert_eq!(windows.last(), Some(&Duration::from_secs(10)), "capped");
        let d = b.next(Some(Duration::from_secs(5)), &mut rng);
        assert!(d >= Duration::from_secs(5) && d <= Duration::from_millis(5500));
        let d = b.next(Some(Duration::from_secs(3600)), &mut rng);
        assert!(
            d <= Duration::from_secs(11),
            "a huge Retry-After is capped: {d:?}"
        );
        // The same seed gives the same delays: deterministic under simulation.
        let run = |seed| {
            let mut rng = ChaCha8Rng::seed_from_u64(seed);
            let mut b = Backoff::new(Duration::from_millis(100), Duration::from_secs(10));
            (0..5).map(|_| b.next(None, &mut rng)).collect::<Vec<_>>()
        };
        assert_eq!(run(3), run(3));
        assert_ne!(run(3), run(4));
    }
}
