//! Test fixtures of fsdp-rs, kept out of the shipped `fsdp` library: small models with exactly
//! known gradients that run through the real engine ([`toy`]) and the single-process reference
//! the parity tests compare a sharded run with ([`mod@reference`]).

#![warn(missing_docs)]

pub mod reference;
pub mod toy;
