//! Short fuzz run of every reader of a file that comes from outside (see `tests/fuzz/mod.rs`):
//! each reader's valid seeds, every kept input of `tests/fuzz-seeds/<reader>/` (inputs that once
//! broke a reader), then a few thousand mutated inputs. The long run is
//! `benches/fuzz/run.sh` (`cargo run --example fuzz_readers`).

mod fuzz;

#[global_allocator]
static ALLOC: fuzz::Counting = fuzz::Counting;

use std::time::Duration;

fn short(name: &str, inputs: u64) {
    fuzz::quiet_panics();
    // Temporary files on a memory file system when there is one (each input is a file).
    let shm = std::path::Path::new("/dev/shm");
    let dir = if shm.is_dir() {
        tempfile::tempdir_in(shm).or_else(|_| tempfile::tempdir())
    } else {
        tempfile::tempdir()
    }
    .unwrap();
    let seeds = fuzz::make_seeds(&dir.path().join("seeds"));
    let ws = dir.path().join("ws");
    let mut r = fuzz::reader(name, &seeds, &ws);
    let kept = fuzz::kept_inputs(name);
    let rep = fuzz::run_reader(
        &mut r,
        &seeds.by_reader[name],
        &kept,
        inputs,
        Duration::from_secs(10),
        &ws,
        &dir.path().join("failures"),
    );
    assert!(
        rep.failures.is_empty(),
        "{name}: {} of {} inputs failed, first: {:?}",
        rep.failures.len(),
        rep.inputs,
        &rep.failures[..rep.failures.len().min(5)]
    );
    assert!(rep.inputs >= inputs);
    // The seeds are read without error (the mutations only ever start from valid files).
    assert!(
        rep.values >= 1,
        "{name}: no input was read: {:?}",
        rep.kinds
    );
}

#[test]
fn fuzz_safetensors_header_short() {
    short("safetensors_header", 5000);
}

#[test]
fn fuzz_weights_short() {
    short("weights", 3000);
}

#[test]
fn fuzz_weights_index_short() {
    short("weights_index", 2000);
}

#[test]
fn fuzz_rank_file_short() {
    short("rank_file", 2000);
}

#[test]
fn fuzz_manifest_short() {
    short("manifest", 2000);
}

#[test]
fn fuzz_token_file_short() {
    short("token_file", 5000);
}

#[test]
fn fuzz_hf_config_short() {
    short("hf_config", 3000);
}

#[test]
fn fuzz_spec_short() {
    short("spec", 3000);
}

#[test]
fn fuzz_tokenizer_cuts_short() {
    short("tokenizer_cuts", 1000);
}
