//! The errors of building a model.

/// Errors building a model: a bad configuration or an unknown preset name.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// `d_model` is not a multiple of `n_head`.
    #[error("model {name}: d_model {d_model} is not a multiple of n_head {n_head}")]
    HeadsDoNotDivide {
        /// Model name.
        name: String,
        /// Model width.
        d_model: u64,
        /// Number of attention heads.
        n_head: u64,
    },
    /// A size that must be positive is zero.
    #[error("model {name}: {field} must be > 0 (got 0)")]
    ZeroSize {
        /// Model name.
        name: String,
        /// The configuration field (`vocab_size`, `n_positions`, `d_model`, `n_layer`, `n_head`).
        field: &'static str,
    },
    /// The preset name is not one of the known presets.
    #[error("unknown model preset {name:?}; known: tiny, mini, small, base, gpt2, gpt2-medium, gpt2-large, gpt2-xl, llama-tiny, llama-mini, llama2-7b, llama3-8b, llama3-70b")]
    UnknownPreset {
        /// The name asked for.
        name: String,
    },
    /// A configuration the model cannot compute (e.g. query heads not a multiple of the
    /// key/value heads, an odd rotary head dimension).
    #[error("model {name}: {problem}")]
    Invalid {
        /// Model name.
        name: String,
        /// What is wrong, with the numbers.
        problem: String,
    },
    /// A Hugging Face `config.json` that cannot be read or is not supported.
    #[error(transparent)]
    Config(#[from] fsdp_planner::PlanError),
    /// A tensor operation failed (e.g. while evaluating).
    #[error("tensor operation failed: {0}")]
    Candle(#[from] candle_core::Error),
}
