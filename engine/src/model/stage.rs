//! What a unit computes ([`Stage`]) and which implementation of the hot ops computes it
//! ([`OpsPath`]), shared by the decoders.

use super::{composite, ops};
use candle_core::{DType, Device, Tensor};
use fsdp_planner::ModelSpec;

#[cfg(doc)]
use super::Gpt;

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

/// Where each stage of a decoder lives: the unit layout both families share.
///
/// Untied head: `Embed -> 0`, `Block(i) -> i + 1`, `Head -> L + 1`. Tied head: the `root` unit
/// `L` holds the embedding, the final norm and the head, so `Block(i) -> i` and `Embed`,
/// `Head -> L`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct StageUnits {
    /// Number of blocks `L`.
    pub n_layer: usize,
    /// The unit computing [`Stage::Embed`].
    pub embed: usize,
    /// The unit computing [`Stage::Head`].
    pub head: usize,
    /// The unit computing `Block(0)`; `Block(i)` is `first_block + i`.
    pub first_block: usize,
}

impl StageUnits {
    /// The layout of an `n_layer`-block decoder with a tied or untied head.
    pub fn new(n_layer: usize, tied_head: bool) -> Self {
        let (embed, head, first_block) = if tied_head {
            (n_layer, n_layer, 0)
        } else {
            (0, n_layer + 1, 1)
        };
        StageUnits {
            n_layer,
            embed,
            head,
            first_block,
        }
    }

    /// The unit index computing `stage`. Panics if `Block(i)` has `i >= L`.
    pub fn unit_of(&self, stage: Stage) -> usize {
        match stage {
            Stage::Embed => self.embed,
            Stage::Head => self.head,
            Stage::Block(i) => {
                assert!(
                    i < self.n_layer,
                    "block {i} of a {}-layer model",
                    self.n_layer
                );
                self.first_block + i
            }
        }
    }

    /// The forward schedule `(stage, unit)`: the embedding, the `L` blocks, the head (`L + 2`
    /// entries; backward runs it in reverse).
    pub fn stages(&self) -> Vec<(Stage, usize)> {
        let mut s = Vec::with_capacity(self.n_layer + 2);
        s.push((Stage::Embed, self.embed));
        s.extend((0..self.n_layer).map(|i| (Stage::Block(i), self.first_block + i)));
        s.push((Stage::Head, self.head));
        s
    }

    /// The stage at position `index` of [`StageUnits::stages`] (the engine's stage numbering:
    /// `0` the embedding, `1..=L` the blocks, anything later the head).
    pub fn stage_at(&self, index: usize) -> Stage {
        match index {
            0 => Stage::Embed,
            i if i <= self.n_layer => Stage::Block(i - 1),
            _ => Stage::Head,
        }
    }
}

/// The family-specific math of a decoder; [`StageDriver`] runs a stage, the loss and the whole
/// model from it, the same way for the GPT-2 and the Llama families.
pub(super) trait StageMath {
    /// The units and parameters in declaration order.
    fn stage_spec(&self) -> &ModelSpec;
    /// Where each stage lives.
    fn stage_units(&self) -> StageUnits;
    /// The configured ops path.
    fn configured_ops_path(&self) -> OpsPath;
    /// Vocabulary size `V`.
    fn vocab(&self) -> usize;
    /// u32 ids `[B, T]` -> hidden `[B, T, D]`; `p` the embedding unit's parameters.
    fn embed_fwd(&self, p: &[Tensor], ids: &Tensor) -> candle_core::Result<Tensor>;
    /// Block `layer`: hidden `[B, T, D]` -> `[B, T, D]`.
    fn block_fwd(&self, layer: usize, p: &[Tensor], x: &Tensor) -> candle_core::Result<Tensor>;
    /// Final norm and LM head: hidden `[B, T, D]` -> logits `[B·T, V]`.
    fn logits(&self, p: &[Tensor], x: &Tensor) -> candle_core::Result<Tensor>;
}

/// The stage driver shared by the decoder families: parameter checks, the dispatch of a stage,
/// the summed cross-entropy of the head and the whole-model forward of the single-process
/// reference. The public methods of [`Gpt`] and the Llama decoder are these, documented there.
pub(super) trait StageDriver: StageMath {
    /// Whether the fused CPU ops serve tensor `t` (else the composite ops do). Errors: the
    /// `Fused` path with `t` off the CPU.
    fn fused(&self, t: &Tensor) -> candle_core::Result<bool> {
        Ok(self.configured_ops_path().resolve(t.device())? == OpsPath::Fused)
    }

    /// Checks count, shapes and the one float dtype of a stage's unit parameters.
    fn check_params(&self, stage: Stage, params: &[Tensor]) -> candle_core::Result<()> {
        let unit = &self.stage_spec().units[self.stage_units().unit_of(stage)];
        if params.len() != unit.params.len() {
            candle_core::bail!(
                "{stage:?}: unit {} has {} parameters, got {} tensors",
                unit.name,
                unit.params.len(),
                params.len()
            );
        }
        for (p, t) in unit.params.iter().zip(params) {
            let want: Vec<usize> = p.shape.iter().map(|&s| s as usize).collect();
            if t.dims() != want.as_slice() {
                candle_core::bail!("{}: expected shape {want:?}, got {:?}", p.name, t.dims());
            }
        }
        if let Some(first) = params.first() {
            let dt = first.dtype();
            if !matches!(dt, DType::F32 | DType::F64 | DType::BF16 | DType::F16) {
                candle_core::bail!(
                    "{stage:?}: unit {}: parameter {} is {dt:?}; parameters must be f32, f64, \
                     bf16 or f16",
                    unit.name,
                    unit.params[0].name
                );
            }
            for (p, t) in unit.params.iter().zip(params) {
                if t.dtype() != dt {
                    candle_core::bail!(
                        "{stage:?}: unit {}: parameter {} is {:?} but {} is {dt:?}; all \
                         parameters of a unit must have one dtype (param_dtype)",
                        unit.name,
                        p.name,
                        t.dtype(),
                        unit.params[0].name
                    );
                }
            }
        }
        Ok(())
    }

    /// Forward of one stage (logits `[B, T, V]` for the head).
    fn drive_stage(
        &self,
        stage: Stage,
        params: &[Tensor],
        x: &Tensor,
    ) -> candle_core::Result<Tensor> {
        self.check_params(stage, params)?;
        if stage != Stage::Embed {
            check_activation_dtype(stage, params, x)?;
        }
        match stage {
            Stage::Embed => self.embed_fwd(params, x),
            Stage::Block(i) => self.block_fwd(i, params, x),
            Stage::Head => {
                let (b, t, _) = x.dims3()?;
                self.logits(params, x)?.reshape((b, t, self.vocab()))
            }
        }
    }

    /// The head with the loss: the 0-dim sum over the `B·T` tokens of the cross-entropy.
    fn drive_head_loss(
        &self,
        params: &[Tensor],
        x: &Tensor,
        targets: &Tensor,
    ) -> candle_core::Result<Tensor> {
        self.check_params(Stage::Head, params)?;
        check_activation_dtype(Stage::Head, params, x)?;
        let (b, t, _) = x.dims3()?;
        let (tb, tt) = targets.dims2()?;
        if (tb, tt) != (b, t) {
            candle_core::bail!("head_loss: targets are [{tb}, {tt}], hidden is [{b}, {t}, _]");
        }
        let logits = self.logits(params, x)?;
        let targets = targets.flatten_all()?;
        if self.fused(&logits)? {
            ops::cross_entropy_sum(&logits, &targets)
        } else {
            composite::cross_entropy_sum(&logits, &targets)
        }
    }

    /// The whole model as one autograd graph: `params` per unit -> the summed cross-entropy.
    fn drive_forward_loss(
        &self,
        params: &[Vec<Tensor>],
        ids: &Tensor,
        targets: &Tensor,
    ) -> candle_core::Result<Tensor> {
        if params.len() != self.stage_spec().units.len() {
            candle_core::bail!(
                "forward_loss: {} units of parameters for a {}-unit model",
                params.len(),
                self.stage_spec().units.len()
            );
        }
        let mut x = ids.clone();
        for (stage, unit) in self.stage_units().stages() {
            if stage == Stage::Head {
                return self.drive_head_loss(&params[unit], &x, targets);
            }
            x = self.drive_stage(stage, &params[unit], &x)?;
        }
        unreachable!("stages() ends with Head")
    }
}

impl<M: StageMath> StageDriver for M {}
