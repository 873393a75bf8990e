//! A fixed team of worker threads for the hot path's fork-join regions.
//!
//! A decode step forks and joins about five times per layer (projections, attention, MLP): 150
//! regions of a few hundred microseconds each per token. A work-stealing pool that parks its
//! threads between regions pays a wake-up (a futex and a reschedule, tens of microseconds on a
//! loaded two-core machine) every time. The team's workers instead spin on one atomic word for a
//! short while after each region and only then sleep on a condition variable, so back-to-back
//! regions start within a cache-line transfer.
//!
//! [`run`] gives unit `i` of `0..units` to thread `i` (unit 0 to the caller), each unit wholly to
//! one thread, so a caller that splits work into fixed ranges gets results that do not depend on
//! scheduling. A region started from inside a region, or while another thread holds the team,
//! runs its units one after the other on the calling thread: same results, no deadlock.
//!
//! Invariants:
//! - The job pointer is written only while no worker can read it: before the region's word is
//!   published (release) and after every counted worker has finished the previous region
//!   (`pending` reached 0, acquire).
//! - The word packs the region's epoch with its unit count, so a worker never pairs one region's
//!   epoch with another's count.
//! - A panic in a unit is caught on the worker, counted, and re-raised on the caller after the
//!   region ends; the worker lives on.

use std::cell::{Cell, UnsafeCell};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, OnceLock, TryLockError};
use std::time::{Duration, Instant};

/// Most units one region takes (the caller plus the workers).
pub const MAX_UNITS: usize = 64;
/// How long an idle worker spins on the word before it sleeps.
const SPIN: Duration = Duration::from_micros(400);
/// How long the caller spins on the workers before it yields its core between checks.
const WAIT_SPIN: Duration = Duration::from_micros(200);
const UNIT_BITS: u32 = 8;

type Job = *const (dyn Fn(usize) + Sync);

struct Shared {
    /// `epoch << UNIT_BITS | units` of the latest region.
    word: AtomicU64,
    job: UnsafeCell<Option<Job>>,
    /// Workers of the current region still running their unit.
    pending: AtomicUsize,
    panicked: AtomicBool,
    sleepers: AtomicUsize,
    lock: Mutex<()>,
    wake: Condvar,
}

// SAFETY: `job` is written only by the thread holding `Team::entry` while no worker reads it,
// and read by workers only between the region's release store of `word` and their release
// decrement of `pending` (see the module invariants); everything else is atomics and locks.
unsafe impl Sync for Shared {}

struct Team {
    shared: &'static Shared,
    /// Held by the thread that runs a region; also guards `workers`.
    entry: Mutex<usize>,
}

thread_local! {
    /// Set on the team's workers and on a caller while it runs a region.
    static INSIDE: Cell<bool> = const { Cell::new(false) };
}

fn team() -> &'static Team {
    static TEAM: OnceLock<Team> = OnceLock::new();
    TEAM.get_or_init(|| Team {
        shared: Box::leak(Box::new(Shared {
            word: AtomicU64::new(0),
            job: UnsafeCell::new(None),
            pending: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
            sleepers: AtomicUsize::new(0),
            lock: Mutex::new(()),
            wake: Condvar::new(),
        })),
        entry: Mutex::new(0),
    })
}

/// The variable that sets [`default_threads`]: a count of threads, at least 1.
const THREADS_VAR: &str = "ENGRAM_THREADS";

/// Threads a forward splits its work over when its configuration says 0: `ENGRAM_THREADS` where
/// set to a count of at least 1, else one per CPU. Several processes sharing a machine (`make
/// test` runs one test process per core) set it to 1, so that no region waits on a worker the
/// other process has taken the core from.
pub fn default_threads() -> usize {
    threads_from(std::env::var(THREADS_VAR).ok().as_deref())
}

fn threads_from(var: Option<&str>) -> usize {
    match var.map(str::trim).and_then(|v| v.parse::<usize>().ok()) {
        Some(n) if n >= 1 => n.min(MAX_UNITS),
        _ => std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get),
    }
}

/// Runs `f(i)` for every `i` in `0..units`, unit `i` on the team's thread `i` (unit 0 on the
/// calling thread), and returns when all are done. `units` above [`MAX_UNITS`] are clamped
/// into runs of the same function on the last thread. Runs serially where the team cannot be
/// had (see the module doc) or its threads cannot be started.
pub fn run(units: usize, f: &(dyn Fn(usize) + Sync)) {
    if units <= 1 || INSIDE.with(Cell::get) {
        (0..units).for_each(f);
        return;
    }
    let team = team();
    let mut workers = match team.entry.try_lock() {
        Ok(g) => g,
        Err(TryLockError::Poisoned(p)) => p.into_inner(),
        Err(TryLockError::WouldBlock) => {
            (0..units).for_each(f);
            return;
        }
    };
    let threads = units.min(MAX_UNITS);
    while *workers < threads - 1 {
        let index = *workers + 1;
        let shared = team.shared;
        // The epoch the worker has seen: it must wait for the next one, even if it starts
        // after this caller publishes it.
        let seen = shared.word.load(Ordering::Acquire) >> UNIT_BITS;
        let started = std::thread::Builder::new()
            .name(format!("engram-team-{index}"))
            .spawn(move || worker(shared, index, seen));
        if started.is_err() {
            break;
        }
        *workers += 1;
    }
    let threads = threads.min(*workers + 1);
    // Units past the team's size run on the last thread, in order.
    let last = threads - 1;
    let body = |i: usize| {
        if i == last {
            (last..units).for_each(f);
        } else {
            f(i);
        }
    };
    INSIDE.with(|c| c.set(true));
    let shared = team.shared;
    let body: &(dyn Fn(usize) + Sync) = &body;
    // SAFETY: the pointer's lifetime is erased; it is read only by workers counted in
    // `pending`, and this function does not return before `pending` is 0 (below), so it never
    // outlives `body`. No worker reads `job` now: the previous region ended with `pending` 0.
    unsafe {
        let job: Job = std::mem::transmute::<&(dyn Fn(usize) + Sync), Job>(body);
        *shared.job.get() = Some(job);
    }
    shared.pending.store(threads - 1, Ordering::SeqCst);
    let epoch = (shared.word.load(Ordering::Relaxed) >> UNIT_BITS) + 1;
    shared
        .word
        .store(epoch << UNIT_BITS | threads as u64, Ordering::SeqCst);
    if shared.sleepers.load(Ordering::SeqCst) > 0 {
        let _g = shared.lock.lock().unwrap_or_else(|p| p.into_inner());
        shared.wake.notify_all();
    }
    let mine = catch_unwind(AssertUnwindSafe(|| body(0)));
    let start = Instant::now();
    let mut spins = 0u32;
    while shared.pending.load(Ordering::Acquire) != 0 {
        spins = spins.wrapping_add(1);
        if spins.is_multiple_of(64) && start.elapsed() > WAIT_SPIN {
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
    }
    // SAFETY: every counted worker is done with `job` (pending is 0, acquired above).
    unsafe { *shared.job.get() = None };
    INSIDE.with(|c| c.set(false));
    let theirs = shared.panicked.swap(false, Ordering::AcqRel);
    drop(workers);
    if let Err(p) = mine {
        std::panic::resume_unwind(p);
    }
    if theirs {
        // Re-raise on the caller, as a scope does: a unit panicked on a worker.
        std::panic::resume_unwind(Box::new("a team unit panicked on a worker thread"));
    }
}

fn worker(shared: &'static Shared, index: usize, mut seen: u64) {
    INSIDE.with(|c| c.set(true));
    loop {
        let word = wait_for_region(shared, seen);
        seen = word >> UNIT_BITS;
        let units = (word & ((1 << UNIT_BITS) - 1)) as usize;
        if index >= units {
            continue;
        }
        // SAFETY: this worker is counted in `pending` for this region, so the caller keeps
        // `job` (and the closure behind it) alive and unchanged until the decrement below.
        let job = unsafe { *shared.job.get() };
        if let Some(job) = job {
            // SAFETY: as above, the closure outlives this call.
            let f = unsafe { &*job };
            if catch_unwind(AssertUnwindSafe(|| f(index))).is_err() {
                shared.panicked.store(true, Ordering::Release);
            }
        }
        shared.pending.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Spins until the word's epoch moves past `seen`, then sleeps until it does.
fn wait_for_region(shared: &Shared, seen: u64) -> u64 {
    let start = Instant::now();
    let mut spins = 0u32;
    loop {
        let word = shared.word.load(Ordering::Acquire);
        if word >> UNIT_BITS != seen {
            return word;
        }
        spins = spins.wrapping_add(1);
        if spins.is_multiple_of(256) && start.elapsed() > SPIN {
            break;
        }
        std::hint::spin_loop();
    }
    let mut g = shared.lock.lock().unwrap_or_else(|p| p.into_inner());
    shared.sleepers.fetch_add(1, Ordering::SeqCst);
    let word = loop {
        let word = shared.word.load(Ordering::SeqCst);
        if word >> UNIT_BITS != seen {
            break word;
        }
        g = shared.wake.wait(g).unwrap_or_else(|p| p.into_inner());
    };
    shared.sleepers.fetch_sub(1, Ordering::SeqCst);
    word
}

#[cfg(test)]
mod tests {
    #![allow(clippy::panic)]

    use std::sync::atomic::AtomicUsize;

    use super::*;

    #[test]
    fn the_variable_sets_the_default_thread_count_within_bounds() {
        let cpus = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
        assert_eq!(threads_from(Some("1")), 1);
        assert_eq!(threads_from(Some(" 3 ")), 3);
        assert_eq!(threads_from(Some("100000")), MAX_UNITS);
        for bad in [None, Some(""), Some("0"), Some("-2"), Some("two")] {
            assert_eq!(threads_from(bad), cpus, "{bad:?}");
        }
    }

    #[test]
    fn every_unit_runs_once_on_its_own_thread_whatever_the_count() {
        for units in [0, 1, 2, 3, 5, 9] {
            let hits: Vec<AtomicUsize> = (0..units).map(|_| AtomicUsize::new(0)).collect();
            let names = Mutex::new(vec![String::new(); units]);
            run(units, &|i| {
                hits[i].fetch_add(1, Ordering::Relaxed);
                let name = std::thread::current().name().unwrap_or("").to_string();
                names.lock().unwrap_or_else(|p| p.into_inner())[i] = name;
            });
            assert!(
                hits.iter().all(|h| h.load(Ordering::Relaxed) == 1),
                "{units}"
            );
            // Unit i runs on team thread i, or every unit on the caller while another test
            // holds the team.
            let names = names.into_inner().unwrap_or_else(|p| p.into_inner());
            let caller = std::thread::current().name().unwrap_or("").to_string();
            let serial = names.iter().all(|n| n == &caller);
            for (i, n) in names.iter().enumerate().skip(1) {
                assert!(
                    serial || n == &format!("engram-team-{i}"),
                    "unit {i} of {units} ran on {n}"
                );
            }
        }
    }

    #[test]
    fn regions_after_the_workers_slept_and_nested_regions_still_run_every_unit() {
        let total = AtomicUsize::new(0);
        for round in 0..3 {
            if round > 0 {
                std::thread::sleep(SPIN * 4);
            }
            run(2, &|_| {
                // A nested region runs serially on this thread.
                run(3, &|j| {
                    total.fetch_add(j + 1, Ordering::Relaxed);
                });
            });
        }
        assert_eq!(total.load(Ordering::Relaxed), 3 * 2 * 6);
    }

    #[test]
    fn regions_from_many_threads_at_once_all_complete() {
        let total = AtomicUsize::new(0);
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for _ in 0..200 {
                        run(3, &|i| {
                            total.fetch_add(i, Ordering::Relaxed);
                        });
                    }
                });
            }
        });
        assert_eq!(total.load(Ordering::Relaxed), 4 * 200 * 3);
    }

    #[test]
    fn a_panicking_unit_reaches_the_caller_and_the_team_lives_on() {
        let r = catch_unwind(|| {
            run(2, &|i| {
                if i == 1 {
                    panic!("unit 1");
                }
            })
        });
        assert!(r.is_err());
        let total = AtomicUsize::new(0);
        run(2, &|i| {
            total.fetch_add(i + 1, Ordering::Relaxed);
        });
        assert_eq!(total.load(Ordering::Relaxed), 3);
    }
}
