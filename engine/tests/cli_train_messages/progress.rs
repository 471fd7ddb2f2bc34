//! Progress without a terminal: a line every `--log-every` steps and at the last, under 100
//! columns, and every checkpoint save reported as text or as a JSON event.

use std::process::Command;

fn run(extra: &[&str]) -> (i32, String, String) {
    let o = Command::new(env!("CARGO_BIN_EXE_fsdp"))
        .args([
            "train",
            "--micro-batch",
            "1",
            "--seq-len",
            "16",
            "--warmup",
            "1",
            "--eval-batches",
            "1",
            "--threads-per-rank",
            "1",
        ])
        .args(extra)
        .output()
        .unwrap();
    (
        o.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

#[test]
fn log_every_prints_steps_and_saves() {
    let t = tempfile::tempdir().unwrap();
    let ck = t.path().join("ck");
    let ck = ck.to_str().unwrap();
    let (code, out, err) = run(&[
        "--steps",
        "12",
        "--log-every",
        "5",
        "--ckpt-dir",
        ck,
        "--ckpt-every",
        "6",
    ]);
    assert_eq!(code, 0, "{err}");
    let steps: Vec<&str> = out.lines().filter(|l| l.starts_with("step ")).collect();
    let heads: Vec<&str> = steps
        .iter()
        .map(|l| l.split(" | ").next().unwrap())
        .collect();
    assert_eq!(heads, ["step 5/12", "step 10/12", "step 12/12"], "{out}");
    for l in &steps {
        assert!(l.len() < 100, "{} columns: {l}", l.len());
        assert!(
            l.contains(" | lr ") && l.contains(" tok/s | comm ") && l.contains(" ms | mem "),
            "{l}"
        );
    }
    let saves: Vec<&str> = out.lines().filter(|l| l.starts_with("saved ")).collect();
    assert_eq!(saves.len(), 2, "{out}");
    assert!(
        saves[0].starts_with(&format!("saved step 6 to {ck}/step-00000006 in ")),
        "{out}"
    );
    assert!(saves[1].starts_with(&format!("saved step 12 to {ck}/step-00000012 in ")));
    assert!(
        saves.iter().all(|l| l.contains(" s (") && l.len() < 100),
        "{out}"
    );
    // --json: one event line per save, naming a directory that exists.
    let ck2 = t.path().join("ck2");
    let (code, out, err) = run(&[
        "--steps",
        "4",
        "--json",
        "--ckpt-dir",
        ck2.to_str().unwrap(),
        "--ckpt-every",
        "2",
    ]);
    assert_eq!(code, 0, "{err}");
    let events: Vec<serde_json::Value> = out
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|v| v["event"] == "checkpoint")
        .collect();
    assert_eq!(events.len(), 2, "{out}");
    for (e, step) in events.iter().zip([2u64, 4]) {
        assert_eq!(e["step"], step);
        let dir = std::path::PathBuf::from(e["path"].as_str().unwrap());
        assert_eq!(dir, ck2.join(format!("step-{step:08}")));
        assert!(dir.join("manifest.json").is_file());
        // The bytes saved: the sizes of the step directory's files (the manifest and the rank
        // files), summed here from the file system.
        let files: Vec<std::fs::Metadata> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|f| f.unwrap().metadata().unwrap())
            .filter(|m| m.is_file())
            .collect();
        assert!(files.len() >= 2, "{dir:?}");
        let on_disk: u64 = files.iter().map(|m| m.len()).sum();
        assert_eq!(e["bytes"].as_u64(), Some(on_disk), "{e}");
        assert!(e["seconds"].as_f64().unwrap() >= 0.0, "{e}");
    }
}
