//! Stand-in for the CUDA forward when the crate is built without the `cuda` feature. The model
//! holds these types either way; here they are empty. No CUDA hot tier can exist without the
//! feature (kvcore's own stub refuses to build one), so [`Llama::forward_cuda`] is never
//! reached; it still answers with a typed error.

use candle_core::Tensor;
use engram_kvcore::BlockStore;

use super::{KvTransform, Llama, SeqInput};
use crate::error::{ModelError, ModelResult};
use crate::weights::Layer;

/// The compiled kernels of a device (none without the feature).
#[derive(Debug, Clone, Default)]
pub(crate) struct KernelCache {
    _none: (),
}

/// A layer's stacked device projections (none without the feature).
#[derive(Debug, Clone)]
pub(crate) enum DeviceStack {}

/// The layers unchanged and no stacks: without the feature no model is on a CUDA device.
pub(crate) fn stack_layers(layers: Vec<Layer>) -> ModelResult<(Vec<Layer>, Vec<DeviceStack>)> {
    Ok((layers, Vec::new()))
}

impl Llama {
    /// Never reached: no CUDA hot tier exists without the feature.
    pub(super) fn forward_cuda(
        &self,
        _store: &mut BlockStore,
        _batch: &[SeqInput<'_>],
        _transform: KvTransform<'_>,
    ) -> ModelResult<Tensor> {
        // Without the feature a model holds no kernels and no device stacks.
        let (_kernels, stacks) = (&self.kernels, self.device_stacks.as_slice());
        debug_assert!(stacks.is_empty());
        Err(ModelError::Device(
            "this build has no CUDA forward (build with the `cuda` feature)".into(),
        ))
    }
}
