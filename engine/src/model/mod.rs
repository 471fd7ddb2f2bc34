//! The decoders computed one FSDP unit at a time on candle-core tensors, from the parameter
//! tensors the engine unshards: the GPT-2 decoder ([`Gpt`], [`mod@gpt`]), the Llama family
//! ([`llama`]) and the enum over both that the training driver runs ([`decoder`]); what a unit
//! computes and on which implementation of the hot ops ([`Stage`], [`OpsPath`]); the fused CPU
//! ops ([`ops`]) and their candle-primitive counterparts ([`composite`]); model errors
//! ([`ModelError`]) and the platform-independent logarithm of the initialisation ([`det_ln`]).

pub mod composite;
pub mod decoder;
mod det_ln;
mod error;
pub mod gpt;
pub mod llama;
pub mod ops;
mod stage;

pub use composite::{
    bias_add_ref, causal_softmax_ref, cross_entropy_sum_ref, gelu_ref, layer_norm_ref,
};
pub use det_ln::det_ln;
pub use error::ModelError;
pub use gpt::{Gpt, INIT_STD, LN_EPS};
pub use stage::{OpsPath, Stage};
