//! Server-side metrics (lock-free): the TTFT histogram. Cache counters come from the engine.

use std::sync::atomic::{AtomicU64, Ordering};

/// Upper bounds of the TTFT buckets, in seconds.
pub const TTFT_BUCKETS: [f64; 10] = [0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0];

/// Counters updated by handlers.
#[derive(Debug, Default)]
pub struct Metrics {
    ttft_buckets: [AtomicU64; 10],
    ttft_count: AtomicU64,
    ttft_sum_us: AtomicU64,
    replayed_turns: AtomicU64,
}

impl Metrics {
    /// Records one time to first token.
    pub fn observe_ttft(&self, ms: f64) {
        let s = ms / 1e3;
        for (b, &le) in self.ttft_buckets.iter().zip(&TTFT_BUCKETS) {
            if s <= le {
                b.fetch_add(1, Ordering::Relaxed);
            }
        }
        self.ttft_count.fetch_add(1, Ordering::Relaxed);
        self.ttft_sum_us
            .fetch_add((ms * 1e3) as u64, Ordering::Relaxed);
    }

    /// Counts turns replayed to recompute lost blocks.
    pub fn count_replayed(&self, n: u64) {
        self.replayed_turns.fetch_add(n, Ordering::Relaxed);
    }

    /// Turns replayed so far.
    pub fn replayed(&self) -> u64 {
        self.replayed_turns.load(Ordering::Relaxed)
    }

    /// The histogram in Prometheus text format.
    pub fn render_ttft(&self, out: &mut String) {
        out.push_str("# HELP engram_ttft_seconds Time from submission to the first token.\n");
        out.push_str("# TYPE engram_ttft_seconds histogram\n");
        for (b, le) in self.ttft_buckets.iter().zip(TTFT_BUCKETS) {
            out.push_str(&format!(
                "engram_ttft_seconds_bucket{{le=\"{le}\"}} {}\n",
                b.load(Ordering::Relaxed)
            ));
        }
        let count = self.ttft_count.load(Ordering::Relaxed);
        out.push_str(&format!(
            "engram_ttft_seconds_bucket{{le=\"+Inf\"}} {count}\n"
        ));
        out.push_str(&format!(
            "engram_ttft_seconds_sum {}\n",
            self.ttft_sum_us.load(Ordering::Relaxed) as f64 / 1e6
        ));
        out.push_str(&format!("engram_ttft_seconds_count {count}\n"));
        out.push_str(
            "# HELP engram_replayed_turns_total Earlier turns replayed to recompute lost blocks.\n",
        );
        out.push_str("# TYPE engram_replayed_turns_total counter\n");
        out.push_str(&format!(
            "engram_replayed_turns_total {}\n",
            self.replayed()
        ));
    }
}
