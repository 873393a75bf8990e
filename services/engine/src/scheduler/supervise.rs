//! The engine thread's supervision: what a panic while serving fails, and the injected faults
//! its tests use (see [`crate::EngineFault`]).

use super::{StreamEvent, Worker};
use crate::core::{FaultKind, SeqId};
use crate::error::EngineError;

impl Worker {
    /// Whether an injected fault of `kind` fires now (the text of sequence `only`, or of any
    /// running one, holds its marker). Only ever true when the configuration asks for a fault.
    pub(super) fn fault(&self, kind: FaultKind, only: Option<SeqId>) -> bool {
        let Some(f) = &self.core.config().fault else {
            return false;
        };
        f.kind == kind
            && self
                .running
                .iter()
                .filter(|a| only.is_none_or(|o| o == a.id))
                .any(|a| {
                    self.core
                        .tokens(a.id)
                        .and_then(|t| self.core.tokenizer().decode(t).ok())
                        .is_some_and(|text| text.contains(&f.marker))
                })
    }

    /// After a panic: the requests that were being served fail and are released (a release
    /// that panics again leaves the sequence's blocks behind rather than the engine).
    pub(super) fn recover(&mut self, what: String) {
        tracing::error!("engine: a request panicked and was failed: {what}");
        let serving = std::mem::take(&mut self.serving);
        let mut i = 0;
        while i < self.running.len() {
            if serving.contains(&self.running[i].id) || self.running[i].finished {
                let a = self.running.remove(i);
                if !a.finished {
                    let _ =
                        a.tx.send(StreamEvent::Failed(EngineError::Panicked(what.clone())));
                }
                let core = &mut self.core;
                let released =
                    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| core.finish(a.id)));
                if released.is_err() {
                    tracing::error!("engine: releasing a failed request panicked too");
                }
            } else {
                i += 1;
            }
        }
        // A reservation whose computation panicked is given up.
        let (failed, kept): (Vec<_>, Vec<_>) = std::mem::take(&mut self.reserving)
            .into_iter()
            .partition(|(seq, _)| serving.contains(seq));
        self.reserving = kept;
        for (seq, id) in failed {
            let core = &mut self.core;
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                if core.complete_reservation(id, true).is_err() {
                    let _ = core.drop_sequence(seq);
                }
            }));
        }
    }
}

/// The text of a panic's payload.
pub(super) fn panic_text(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".into())
}

/// The injected fault's panic (see [`crate::EngineFault`]).
#[allow(clippy::panic)] // The point of the fault: the supervisor's tests need a real panic.
pub(super) fn injected_panic() -> ! {
    panic!("injected fault: a panic while serving a request")
}
