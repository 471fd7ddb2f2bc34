//! The Llama-family decoder (`fsdp::model::llama::Llama`): golden values from Hugging Face
//! transformers (`golden`), bitwise parity of every strategy with the single-process reference
//! (`parity`), the ledger against the plan (`memory`), and `fsdp train` / `fsdp plan` on Llama
//! configs end to end (`cli`).

mod common;

#[path = "model_llama/cli.rs"]
mod cli;
#[path = "model_llama/golden.rs"]
mod golden;
#[path = "model_llama/memory.rs"]
mod memory;
#[path = "model_llama/parity.rs"]
mod parity;
