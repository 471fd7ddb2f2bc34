//! [`Decoder`]: the decoder-only language models `fsdp train` runs, one enum over the model
//! families, so the training driver, its hooks and the checkpoint layer take one type. Each
//! variant is a [`StagedModel`] and the enum forwards every call unchanged (the GPT path
//! computes the same bits through it as on its own).

use super::llama::Llama;
use super::{Gpt, ModelError, OpsPath};
use crate::runtime::staged::{MicroBatch, StagedModel};
use candle_core::Tensor;
use fsdp_planner::presets::{byte_gpt_config, llama_config, openai_gpt2_config};
use fsdp_planner::{hf, Architecture, ModelSpec};
use std::path::Path;

/// A decoder-only language model of a supported family.
#[derive(Debug, Clone)]
pub enum Decoder {
    /// GPT-2 style ([`Gpt`]).
    Gpt(Gpt),
    /// Llama, Mistral or Qwen2 style ([`Llama`]).
    Llama(Llama),
}

impl Decoder {
    /// A built-in preset: the GPT presets of [`Gpt::from_preset`] or the Llama presets of
    /// [`Llama::from_preset`].
    ///
    /// Errors: [`ModelError::UnknownPreset`] naming every known preset.
    pub fn from_preset(name: &str) -> Result<Self, ModelError> {
        if byte_gpt_config(name).is_some() || openai_gpt2_config(name).is_some() {
            return Gpt::from_preset(name).map(Decoder::Gpt);
        }
        if llama_config(name).is_some() {
            return Llama::from_preset(name).map(Decoder::Llama);
        }
        Err(ModelError::UnknownPreset {
            name: name.to_string(),
        })
    }

    /// The model of a Hugging Face `config.json`, with exactly the spec `fsdp plan
    /// --hf-config` plans ([`hf::read_hf_config`]: same parameters, units and name): a GPT for
    /// `model_type` `gpt2`, a [`Llama`] with the file's numerics
    /// ([`hf::read_llama_numerics`]) for `llama`, `mistral` and `qwen2`.
    ///
    /// Errors: [`ModelError::Config`] for an unreadable, malformed or unsupported file (naming
    /// the file and the field); as [`Gpt::new`] / [`Llama::new`].
    pub fn from_hf_config(path: &Path) -> Result<Self, ModelError> {
        let spec = hf::read_hf_config(path)?;
        let model = match spec.arch {
            Architecture::Gpt2(c) => {
                hf::read_gpt2_numerics(path)?;
                Decoder::Gpt(Gpt::new(&spec.name, c)?)
            }
            Architecture::Llama(c) => {
                let n = hf::read_llama_numerics(path)?;
                Decoder::Llama(Llama::new(&spec.name, c, n)?)
            }
            Architecture::Generic => unreachable!("a config.json always names a family"),
        };
        debug_assert_eq!(
            model.spec(),
            &spec,
            "the planner's spec of {}",
            path.display()
        );
        Ok(model)
    }

    /// The model of a `config.json`'s text (`file` names it in messages), named `name`: as
    /// [`Decoder::from_hf_config`] for a text held elsewhere (a checkpoint's manifest).
    ///
    /// Errors: as [`Decoder::from_hf_config`].
    pub fn from_hf_config_text(text: &str, file: &str, name: &str) -> Result<Self, ModelError> {
        let spec = hf::parse_hf_config(text, file, name)?;
        Ok(match spec.arch {
            Architecture::Gpt2(c) => {
                hf::check_gpt2_numerics(text, file)?;
                Decoder::Gpt(Gpt::new(&spec.name, c)?)
            }
            Architecture::Llama(c) => {
                let n = hf::parse_llama_numerics(text, file)?;
                Decoder::Llama(Llama::new(&spec.name, c, n)?)
            }
            Architecture::Generic => unreachable!("a config.json always names a family"),
        })
    }

    /// The model a run names: the `config.json` at `hf_config` when given, else the preset
    /// `preset`. Errors: as [`Decoder::from_hf_config`] and [`Decoder::from_preset`].
    pub fn resolve(preset: &str, hf_config: Option<&Path>) -> Result<Self, ModelError> {
        match hf_config {
            Some(p) => Decoder::from_hf_config(p),
            None => Decoder::from_preset(preset),
        }
    }

    /// This model computing with `path` ([`OpsPath`]).
    pub fn with_ops_path(self, path: OpsPath) -> Self {
        match self {
            Decoder::Gpt(g) => Decoder::Gpt(g.with_ops_path(path)),
            Decoder::Llama(l) => Decoder::Llama(l.with_ops_path(path)),
        }
    }

    /// Vocabulary size `V` (token ids must be below it).
    pub fn vocab_size(&self) -> u64 {
        match self {
            Decoder::Gpt(g) => g.cfg.vocab_size,
            Decoder::Llama(l) => l.cfg.vocab_size,
        }
    }

    /// The model's name (the preset, or the `config.json`'s directory).
    pub fn name(&self) -> &str {
        &self.spec().name
    }

    /// The longest sequence the model computes exactly, and why: the GPT's position table
    /// (`n_positions`), a Llama's sliding window (Mistral); `None` when there is no limit.
    pub fn max_seq_len(&self) -> Option<(u64, &'static str)> {
        match self {
            Decoder::Gpt(g) => Some((g.cfg.n_positions, "n_positions")),
            Decoder::Llama(l) => l.max_exact_seq_len().map(|w| (w, "sliding_window")),
        }
    }

    /// The seeded random initialisation of the model, read shard by shard
    /// ([`crate::init::RandomInit`]; the model's own rules).
    pub fn random_init(&self, seed: u64) -> crate::init::RandomInit {
        match self {
            Decoder::Gpt(g) => g.random_init(seed),
            Decoder::Llama(l) => l.random_init(seed),
        }
    }
}

impl StagedModel for Decoder {
    fn spec(&self) -> &ModelSpec {
        match self {
            Decoder::Gpt(g) => StagedModel::spec(g),
            Decoder::Llama(l) => StagedModel::spec(l),
        }
    }

    fn stage_units(&self) -> Vec<usize> {
        match self {
            Decoder::Gpt(g) => g.stage_units(),
            Decoder::Llama(l) => l.stage_units(),
        }
    }

    fn forward(&self, stage: usize, params: &[Tensor], x: &Tensor) -> candle_core::Result<Tensor> {
        match self {
            Decoder::Gpt(g) => StagedModel::forward(g, stage, params, x),
            Decoder::Llama(l) => StagedModel::forward(l, stage, params, x),
        }
    }

    fn loss(&self, params: &[Tensor], x: &Tensor, mb: &MicroBatch) -> candle_core::Result<Tensor> {
        match self {
            Decoder::Gpt(g) => g.loss(params, x, mb),
            Decoder::Llama(l) => l.loss(params, x, mb),
        }
    }

    fn init_params(&self, seed: u64) -> Vec<Vec<Vec<f32>>> {
        match self {
            Decoder::Gpt(g) => StagedModel::init_params(g, seed),
            Decoder::Llama(l) => StagedModel::init_params(l, seed),
        }
    }
}
