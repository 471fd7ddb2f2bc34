//! What a unit computes ([`Stage`]) and which implementation of the hot ops computes it
//! ([`OpsPath`]), shared by the decoders.

use candle_core::{Device, Tensor};

#[cfg(doc)]
use super::{composite, ops, Gpt};

/// One step of the forward schedule: which computation a unit performs.
///
/// With an untied head the embedding, each block and the head are separate units. With a tied
/// head the `root` unit holds the embeddings, the final norm and the (tied) LM head, and is used
/// twice: [`Stage::Embed`] first and [`Stage::Head`] last.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Stage {
    /// Token + position embedding: u32 token ids `[B, T]` -> hidden `[B, T, D]`.
    Embed,
    /// Transformer block `layer` (0-based): hidden `[B, T, D]` -> `[B, T, D]`.
    Block(usize),
    /// Final LayerNorm + LM head: hidden `[B, T, D]` -> logits `[B, T, V]` (or a loss, through
    /// [`Gpt::head_loss`]).
    Head,
}

/// Which implementation computes the model's embedding, LayerNorm, causal attention (fused:
/// one op with its own GEMMs; composite: q/k/v copies, candle matmuls around the causal
/// softmax), bias add, bias + GELU and cross-entropy (the linear layers' matrix products and
/// the residual adds are plain candle ops on both paths).
///
/// Both paths have one contract ([`ops`] and [`composite`] module docs): same shapes, errors
/// and dtypes, and in bf16/f16 the same "widen to f32, compute, round once" semantics. They are
/// not bitwise equal to each other (f32 rounding; see `engine/tests/model_device.rs` for the
/// measured differences).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum OpsPath {
    /// Chosen by the device of the tensors: [`OpsPath::Fused`] on the CPU,
    /// [`OpsPath::Composite`] on any other
    /// device (CUDA). The default of [`Gpt::new`] and [`Gpt::from_preset`].
    #[default]
    Auto,
    /// The fused CPU custom ops of [`ops`] (one pass forward, one backward, hand-written
    /// gradients). CPU only: a stage whose tensors live on another device is an error, never a
    /// silent fallback.
    Fused,
    /// The candle-primitive compositions of [`composite`], differentiated by candle autograd,
    /// on every device (the CUDA path; on the CPU, slower than the fused ops, used to test the
    /// CUDA path without a GPU).
    Composite,
}

impl OpsPath {
    /// The concrete path ([`OpsPath::Fused`] or [`OpsPath::Composite`]) that serves tensors on
    /// `device`: `Auto` resolves to `Fused` on the CPU and `Composite` elsewhere.
    ///
    /// Errors: `Fused` with a non-CPU `device` (the fused ops have no GPU kernels).
    pub fn resolve(self, device: &Device) -> candle_core::Result<OpsPath> {
        match self {
            OpsPath::Auto if device.is_cpu() => Ok(OpsPath::Fused),
            OpsPath::Auto | OpsPath::Composite => Ok(OpsPath::Composite),
            OpsPath::Fused if device.is_cpu() => Ok(OpsPath::Fused),
            OpsPath::Fused => candle_core::bail!(
                "ops path Fused: the fused ops run on the CPU only, but the tensors are on \
                 {device:?}; use OpsPath::Auto or OpsPath::Composite"
            ),
        }
    }
}

/// Checks that the hidden states `x` entering `stage` have the dtype of the unit's parameters:
/// f32 activations with bf16 weights (or the reverse) is an error, never a silent cast.
pub(super) fn check_activation_dtype(
    stage: Stage,
    params: &[Tensor],
    x: &Tensor,
) -> candle_core::Result<()> {
    if let Some(p) = params.first() {
        if x.dtype() != p.dtype() {
            candle_core::bail!(
                "{stage:?}: input activations are {:?} but the unit's parameters are {:?} \
                 (param_dtype); cast explicitly",
                x.dtype(),
                p.dtype()
            );
        }
    }
    Ok(())
}
