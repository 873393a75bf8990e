//! Server-side metrics (lock-free): the TTFT histogram, replays and the shadow reads on a miss.
//! Cache counters come from the engine.

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
    disk_hit_blocks: AtomicU64,
    miss_reads: [AtomicU64; 4],
    /// Sessions archived (tokens only) and thawed.
    archive: [AtomicU64; 2],
}

/// How a turn's read of the shadow on a miss ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MissRead {
    /// The shadow held the session: its blocks went back into the cold tier.
    Loaded,
    /// The shadow holds nothing of the session (its blocks are recomputed).
    Absent,
    /// Another node's shadow (`shadow.peers`) held the session: loaded, and adopted into this
    /// node's shadow.
    Adopted,
    /// The shadow's entry could not be used (damaged, another model, a store error): the
    /// blocks are recomputed.
    Failed,
}

impl MissRead {
    const ALL: [Self; 4] = [Self::Loaded, Self::Absent, Self::Adopted, Self::Failed];

    fn label(self) -> &'static str {
        match self {
            Self::Loaded => "loaded",
            Self::Absent => "absent",
            Self::Adopted => "adopted",
            Self::Failed => "failed",
        }
    }
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

    /// Counts one read of the shadow on a miss, and the blocks it loaded into the cold tier.
    pub fn count_miss_read(&self, outcome: MissRead, blocks: u64) {
        self.miss_reads[outcome as usize].fetch_add(1, Ordering::Relaxed);
        self.disk_hit_blocks.fetch_add(blocks, Ordering::Relaxed);
    }

    /// Blocks turns read back from the shadow on a miss so far.
    pub fn disk_hits(&self) -> u64 {
        self.disk_hit_blocks.load(Ordering::Relaxed)
    }

    /// The reads of the shadow on a miss in Prometheus text format.
    pub fn render_miss_reads(&self, out: &mut String) {
        out.push_str(
            "# HELP engram_shadow_miss_reads_total Turns whose cache miss read the session from the shadow, by outcome.\n",
        );
        out.push_str("# TYPE engram_shadow_miss_reads_total counter\n");
        for m in MissRead::ALL {
            out.push_str(&format!(
                "engram_shadow_miss_reads_total{{result=\"{}\"}} {}\n",
                m.label(),
                self.miss_reads[m as usize].load(Ordering::Relaxed)
            ));
        }
    }

    /// Counts a session archived (`thawed` false) or thawed by its next turn.
    pub fn count_archive(&self, thawed: bool) {
        self.archive[usize::from(thawed)].fetch_add(1, Ordering::Relaxed);
    }

    /// The archive's counters in Prometheus text format.
    pub fn render_archive(&self, out: &mut String) {
        out.push_str(
            "# HELP engram_archive_sessions_total Sessions moved to the tokens-only archive (KV deleted, chain kept), and thawed by their next turn's replay.\n",
        );
        out.push_str("# TYPE engram_archive_sessions_total counter\n");
        for (i, event) in ["archived", "thawed"].into_iter().enumerate() {
            out.push_str(&format!(
                "engram_archive_sessions_total{{event=\"{event}\"}} {}\n",
                self.archive[i].load(Ordering::Relaxed)
            ));
        }
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
