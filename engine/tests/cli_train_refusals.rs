//! `fsdp train` refuses, with exit code 2 and a message naming the problem, what it cannot run
//! correctly: gradients reduced in f16 (the sum over ranks overflows before the division by the
//! token count), a process started by a launcher with the in-process thread backend (it would
//! train its own copy of the model), checkpoint flags without a checkpoint directory, a CUDA
//! device or the NCCL backend where they cannot run; `--strategy auto` / `--device-memory`
//! misuse and budgets nothing fits (module `auto`).

use std::process::Command;

#[path = "cli_train_refusals/auto.rs"]
mod auto;

#[path = "cli_train_refusals/flags.rs"]
mod flags;

fn fsdp(args: &[&str], env: &[(&str, &str)]) -> (i32, String) {
    let mut c = Command::new(env!("CARGO_BIN_EXE_fsdp"));
    c.args(args);
    for (k, v) in env {
        c.env(k, v);
    }
    let o = c.output().unwrap();
    (
        o.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

const SMALL: [&str; 10] = [
    "train",
    "--model",
    "tiny",
    "--steps",
    "1",
    "--micro-batch",
    "1",
    "--seq-len",
    "16",
    "--json",
];

#[test]
fn f16_gradient_reduction_is_refused() {
    let mut a = SMALL.to_vec();
    a.extend([
        "--world-size",
        "2",
        "--param-dtype",
        "f16",
        "--reduce-dtype",
        "f16",
    ]);
    let (code, err) = fsdp(&a, &[]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("reduce_dtype f16") && err.contains("bf16"),
        "{err}"
    );
    // f16 compute with bf16 or f32 on the wire runs.
    let mut ok = SMALL.to_vec();
    ok.extend([
        "--world-size",
        "2",
        "--param-dtype",
        "f16",
        "--reduce-dtype",
        "bf16",
    ]);
    let (code, err) = fsdp(&ok, &[]);
    assert_eq!(code, 0, "{err}");
}

#[test]
fn thread_backend_under_a_launcher_is_refused() {
    let (code, err) = fsdp(&SMALL, &[("RANK", "1"), ("WORLD_SIZE", "2")]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("launcher") && err.contains("--world-size 2"),
        "{err}"
    );
    // A world of one under a launcher is a plain single-process run.
    let (code, err) = fsdp(&SMALL, &[("RANK", "0"), ("WORLD_SIZE", "1")]);
    assert_eq!(code, 0, "{err}");
}

#[test]
fn checkpoint_flags_need_a_checkpoint_directory() {
    for flag in ["--ckpt-every", "--keep-last"] {
        let mut a = SMALL.to_vec();
        a.extend([flag, "1"]);
        let (code, err) = fsdp(&a, &[]);
        assert_eq!(code, 2, "{flag}: {err}");
        assert!(err.contains("--ckpt-dir"), "{flag}: {err}");
    }
}

/// Without a CUDA build or device, `--device cuda` is bad input naming what is missing; the
/// NCCL backend outside a launcher names `fsdp launch`; a launched NCCL rank that disagrees on
/// the world size is refused before any GPU work.
#[test]
fn device_and_nccl_backend_refusals_name_the_fix() {
    let mut a = SMALL.to_vec();
    a.extend(["--device", "cuda"]);
    let (code, err) = fsdp(&a, &[("LOCAL_RANK", "0")]);
    // A build with CUDA on a machine with a GPU would train: this test runs where neither is.
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("--device cuda") && err.contains("GPU 0"),
        "{err}"
    );
    let (code, err) = fsdp(
        &[&SMALL[..], &["--device", "cuda"]].concat(),
        &[("LOCAL_RANK", "x")],
    );
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("LOCAL_RANK=\"x\""), "{err}");

    let mut a = SMALL.to_vec();
    a.extend(["--backend", "nccl"]);
    let (code, err) = fsdp(&a, &[]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("fsdp launch --nproc"), "{err}");
    let env = [
        ("RANK", "0"),
        ("WORLD_SIZE", "2"),
        ("LOCAL_RANK", "0"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", "29999"),
    ];
    let mut a = SMALL.to_vec();
    a.extend(["--backend", "nccl", "--world-size", "4"]);
    let (code, err) = fsdp(&a, &env);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("--world-size 4") && err.contains("WORLD_SIZE=2"),
        "{err}"
    );
    // The right world size needs the NCCL backend, which this build (no `cuda` feature) lacks:
    // bad input naming the rebuild, said once.
    let mut a = SMALL.to_vec();
    a.extend(["--backend", "nccl"]);
    let (code, err) = fsdp(&a, &env);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--features cuda"), "{err}");
    assert_eq!(err.matches("--features cuda").count(), 1, "{err}");
    // Timeouts too long for the clock are bad input, not a panic.
    let mut a = SMALL.to_vec();
    a.extend(["--backend", "nccl", "--comm-timeout", "1e20"]);
    let (code, err) = fsdp(&a, &env);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("--comm-timeout") && !err.contains("panicked"),
        "{err}"
    );
    let (code, err) = fsdp(
        &[
            "launch", "--nproc", "2", "--grace", "1e300", "--", "plan", "--model", "tiny",
        ],
        &[],
    );
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("--grace") && !err.contains("panicked"),
        "{err}"
    );
}
