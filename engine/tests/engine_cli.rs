//! `fsdp train` end to end through the binary: JSON lines per step and a summary whose
//! measured memory never exceeds the plan; bad flags exit with code 2 and a message;
//! `--strategy auto` against `fsdp plan --strategy auto` (module `auto`).

use std::process::Command;

#[path = "engine_cli/auto.rs"]
mod auto;

fn fsdp() -> Command {
    Command::new(env!("CARGO_BIN_EXE_fsdp"))
}

fn data() -> String {
    concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../testdata/tinyshakespeare.txt"
    )
    .to_string()
}

#[test]
fn train_cli_json_lines_and_summary_at_world_size_2() {
    let out = fsdp()
        .args([
            "train",
            "--data",
            &data(),
            "--model",
            "tiny",
            "--world-size",
            "2",
        ])
        .args([
            "--strategy",
            "full-shard",
            "--seq-len",
            "32",
            "--micro-batch",
            "2",
        ])
        .args([
            "--grad-accum",
            "2",
            "--steps",
            "4",
            "--warmup",
            "1",
            "--eval-batches",
            "2",
            "--json",
        ])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<serde_json::Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 5, "4 steps + summary: {stdout}");
    for (i, l) in lines[..4].iter().enumerate() {
        assert_eq!(l["step"], i as u64 + 1);
        assert_eq!(l["tokens"], 2 * 2 * 2 * 32, "W x K x B x T tokens per step");
        assert!(l["loss"].as_f64().unwrap().is_finite());
    }
    let s = &lines[4];
    assert_eq!(s["summary"], true);
    assert!(
        s["final_val_loss"].as_f64().unwrap() < 5.6,
        "below ln(256) = 5.55 after 4 steps"
    );
    for rank in s["memory"].as_array().unwrap() {
        for c in rank.as_array().unwrap() {
            assert!(c["measured"].as_u64() <= c["planned"].as_u64(), "{c}");
        }
    }
}

#[test]
fn train_cli_bad_flags_exit_2_with_a_message() {
    let cases: [(&[&str], &str); 6] = [
        (&["--world-size", "0"], "world-size"),
        (
            &["--strategy", "hybrid", "--world-size", "4"],
            "--shard-size",
        ),
        (
            &[
                "--strategy",
                "hybrid",
                "--world-size",
                "4",
                "--shard-size",
                "3",
            ],
            "shard size 3",
        ),
        (&["--model", "huge"], "unknown model preset"),
        (&["--data", "/nonexistent/file.txt"], "nonexistent"),
        (&["--strategy", "zero9"], "zero9"),
    ];
    for (args, needle) in cases {
        let out = fsdp()
            .arg("train")
            .args(args)
            .args(["--steps", "1"])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(needle), "{args:?}: {err}");
    }
}

/// `--activation-checkpointing on|off` on `fsdp train` and `fsdp plan`: the summary and the
/// table name the setting, training without it gives bitwise the same losses, the ledger stays
/// within the plan, a bad value exits 2, and the help says what it trades.
#[test]
fn activation_checkpointing_flag_on_train_and_plan() {
    let train = |flag: Option<&str>| -> serde_json::Value {
        let mut c = fsdp();
        c.args(["train", "--data", &data(), "--model", "tiny"])
            .args(["--world-size", "2", "--seq-len", "32", "--micro-batch", "2"])
            .args([
                "--steps",
                "2",
                "--warmup",
                "1",
                "--eval-batches",
                "1",
                "--json",
            ]);
        if let Some(f) = flag {
            c.args(["--activation-checkpointing", f]);
        }
        let out = c.output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{flag:?}: {stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let last = stdout.lines().last().unwrap();
        serde_json::from_str(last).unwrap()
    };
    let default = train(None);
    let off = train(Some("off"));
    let on = train(Some("on"));
    assert_eq!(
        default["activation_checkpointing"], false,
        "full shard default (FSDP2's: no recompute)"
    );
    assert_eq!(on["activation_checkpointing"], true);
    assert_eq!(off["activation_checkpointing"], false);
    assert_eq!(off["fingerprint"], default["fingerprint"]);
    assert_ne!(on["fingerprint"], default["fingerprint"]);
    assert_eq!(
        off["final_train_loss"].as_f64().unwrap().to_bits(),
        on["final_train_loss"].as_f64().unwrap().to_bits()
    );
    for rank in off["memory"].as_array().unwrap() {
        for c in rank.as_array().unwrap() {
            assert!(c["measured"].as_u64() <= c["planned"].as_u64(), "{c}");
        }
    }
    assert!(off["plan_peak_per_rank"].as_u64() > on["plan_peak_per_rank"].as_u64());

    let out = fsdp()
        .args(["plan", "--model", "mini", "--world-size", "2"])
        .args([
            "--strategy",
            "shard-grad-op",
            "--activation-checkpointing",
            "on",
        ])
        .output()
        .unwrap();
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{table}");
    assert!(
        table.contains("keep unsharded after forward; activation checkpointing"),
        "{table}"
    );

    let out = fsdp()
        .args([
            "train",
            "--activation-checkpointing",
            "sometimes",
            "--steps",
            "1",
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("--activation-checkpointing"), "{err}");
    for cmd in ["train", "plan"] {
        let out = fsdp().args([cmd, "--help"]).output().unwrap();
        let help = String::from_utf8_lossy(&out.stdout);
        assert!(
            help.contains("recompute its forward in backward"),
            "{cmd}: {help}"
        );
    }
}
