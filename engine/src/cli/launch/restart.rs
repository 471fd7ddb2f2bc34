//! What a restart changes: the command line of an `fsdp train` rank (resume from the newest
//! intact checkpoint, the world size of an elastic restart), which device slots are lost, and
//! the world size an elastic restart runs at.

use super::ranks::{Cause, Failure};
use crate::cli::args::{BackendArg, StrategyArg};
use crate::cli::{Cli, Command};
use clap::Parser;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

/// What the launcher knows of the ranks' command: `fsdp train` flags that restarts rewrite.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TrainCommand {
    /// `--ckpt-dir` (relative to the launcher's working directory, which the ranks share).
    pub ckpt_dir: Option<PathBuf>,
    /// `--backend`.
    pub backend: BackendArg,
    /// `--world-size` given on the command line (not its default).
    pub world_size_given: bool,
    /// `--shard-size` of `--strategy hybrid`: an elastic world size must be a multiple of it.
    pub hybrid_shard_size: Option<u64>,
}

/// The ranks' command as the launcher sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RankCommand {
    /// `fsdp train` with these flags.
    Train(TrainCommand),
    /// Another `fsdp` subcommand (`plan`, `eval`, ...), or one that does not parse (the
    /// ranks report it, exit 2).
    OtherFsdp,
    /// A `--program`: the launcher knows nothing of its flags or exit codes.
    Program,
}

impl RankCommand {
    /// Reads `args` (the command after `--`) as this `fsdp` executable's command line, or
    /// [`RankCommand::Program`] for a `--program`.
    pub fn read(program_given: bool, args: &[String]) -> RankCommand {
        if program_given {
            return RankCommand::Program;
        }
        let argv = std::iter::once("fsdp".to_string()).chain(args.iter().cloned());
        match Cli::try_parse_from(argv) {
            Ok(Cli {
                command: Command::Train(t),
            }) => {
                let given = args
                    .iter()
                    .any(|a| a == "--world-size" || a.starts_with("--world-size="));
                RankCommand::Train(TrainCommand {
                    ckpt_dir: t.ckpt.ckpt_dir.clone(),
                    backend: t.backend,
                    world_size_given: given,
                    hybrid_shard_size: match t.strategy {
                        StrategyArg::Hybrid => t.shard_size.filter(|&s| s > 0),
                        _ => None,
                    },
                })
            }
            _ => RankCommand::OtherFsdp,
        }
    }

    /// Whether exit code 2 means bad input that a restart would only repeat (fsdp's own
    /// subcommands; a `--program`'s codes mean what it says).
    pub fn exit_2_is_bad_input(&self) -> bool {
        !matches!(self, RankCommand::Program)
    }

    /// Whether the ranks can run as a world of `w` processes: a hybrid `--shard-size` must
    /// divide it.
    pub fn world_usable(&self, w: usize) -> bool {
        match self {
            RankCommand::Train(t) => t
                .hybrid_shard_size
                .is_none_or(|s| (w as u64).is_multiple_of(s)),
            _ => true,
        }
    }
}

/// The identity of a checkpoint root's `latest` pointer (the pointer is replaced atomically,
/// by rename, at every save): a save changes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LatestMark(Option<(u64, Option<SystemTime>, Vec<u8>)>);

impl LatestMark {
    /// Reads `root/latest` (`None` inside when there is none).
    pub fn read(root: &Path) -> LatestMark {
        let p = root.join(fsdp_checkpoints::LATEST_FILE);
        let Ok(meta) = std::fs::metadata(&p) else {
            return LatestMark(None);
        };
        #[cfg(unix)]
        let ino = std::os::unix::fs::MetadataExt::ino(&meta);
        #[cfg(not(unix))]
        let ino = 0;
        LatestMark(Some((
            ino,
            meta.modified().ok(),
            std::fs::read(&p).unwrap_or_default(),
        )))
    }
}

/// Removes every occurrence of flag `name` (`--name`, and with `takes_value` its value, as
/// `--name V` or `--name=V`) from `args`.
pub fn remove_flag(args: &mut Vec<String>, name: &str, takes_value: bool) {
    let mut out = Vec::with_capacity(args.len());
    let mut i = 0;
    while i < args.len() {
        let a = &args[i];
        if a == name {
            i += if takes_value { 2 } else { 1 };
            continue;
        }
        if takes_value && a.starts_with(name) && a[name.len()..].starts_with('=') {
            i += 1;
            continue;
        }
        out.push(a.clone());
        i += 1;
    }
    *args = out;
}

/// How a restart resumes, for the restart line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Resume {
    /// The job saved a checkpoint: `--resume-from latest-valid` replaces the command's resume
    /// flags.
    LatestValid,
    /// No checkpoint of this job yet: the command as given (a fresh run from step 0, or the
    /// resume it asked for).
    AsGiven,
    /// `train` without `--ckpt-dir`: from step 0.
    NoCheckpoints,
    /// Not an `fsdp train` command: rerun as given.
    NotTrain,
}

impl Resume {
    /// The words of the restart line.
    pub fn describe(&self) -> &'static str {
        match self {
            Resume::LatestValid => {
                "resuming from the newest intact checkpoint (--resume-from latest-valid)"
            }
            Resume::AsGiven => "no checkpoint saved yet: rerunning the command as given",
            Resume::NoCheckpoints => "no --ckpt-dir: training again from step 0",
            Resume::NotTrain => "rerunning the command",
        }
    }
}

/// The command line of restart `restart` (0 = the first attempt) at world size `world`:
/// for `fsdp train` with `--ckpt-dir`, once the job saved a checkpoint (`saved`),
/// `--resume-from latest-valid` in place of `--resume` / `--resume-from`; with `--backend
/// nccl` and `--world-size` given, `--world-size` set to `world` (the launcher's world size
/// after an elastic restart). Everything else is unchanged.
pub fn command_for(
    cmd: &RankCommand,
    args: &[String],
    restart: u32,
    world: usize,
    saved: bool,
) -> (Vec<String>, Resume) {
    let mut out = args.to_vec();
    let RankCommand::Train(t) = cmd else {
        return (out, Resume::NotTrain);
    };
    if t.world_size_given && t.backend == BackendArg::Nccl {
        remove_flag(&mut out, "--world-size", true);
        out.extend(["--world-size".to_string(), world.to_string()]);
    }
    let resume = if t.ckpt_dir.is_none() {
        Resume::NoCheckpoints
    } else if restart > 0 && saved {
        remove_flag(&mut out, "--resume", false);
        remove_flag(&mut out, "--resume-from", true);
        out.extend(["--resume-from".to_string(), "latest-valid".to_string()]);
        Resume::LatestValid
    } else {
        Resume::AsGiven
    };
    (out, resume)
}

/// The elastic rule: which device slot fails at start-up again and again.
///
/// A slot is lost when its rank was the first to fail in `LOST_AFTER` consecutive attempts,
/// each time within the start-up window of its attempt's start (a device or node that cannot
/// run a rank fails it while it initialises; a failure later in training is not the slot's),
/// or when its process could not be started at all.
#[derive(Debug, Clone)]
pub struct SlotHealth {
    window: Duration,
    /// The slot that failed first at start-up in the previous attempts, and how many times in
    /// a row.
    streak: Option<(usize, u32)>,
}

/// Consecutive first failures at start-up that make a slot lost.
pub const LOST_AFTER: u32 = 2;

impl SlotHealth {
    /// No failure seen yet; `window` is the start-up window.
    pub fn new(window: Duration) -> SlotHealth {
        SlotHealth {
            window,
            streak: None,
        }
    }

    /// Records the attempt's first failure `f` on device slot `slot`; returns the slot when it
    /// is now lost (the streak restarts after that).
    pub fn record(&mut self, f: &Failure, slot: usize) -> Option<usize> {
        if matches!(f.cause, Cause::NotStarted(_)) {
            self.streak = None;
            return Some(slot);
        }
        if f.after > self.window {
            self.streak = None;
            return None;
        }
        let n = match self.streak {
            Some((s, n)) if s == slot => n + 1,
            _ => 1,
        };
        if n >= LOST_AFTER {
            self.streak = None;
            Some(slot)
        } else {
            self.streak = Some((slot, n));
            None
        }
    }
}

/// The world size an elastic restart runs at: the largest `w` with `min <= w <= healthy` the
/// command can use (a hybrid `--shard-size` divides it).
///
/// Errors: the reason, for the launcher's exit-1 line, when no such `w` exists.
pub fn elastic_world(cmd: &RankCommand, healthy: usize, min: usize) -> Result<usize, String> {
    if healthy < min {
        return Err(format!(
            "only {healthy} device slots can run a rank, fewer than --min-nproc {min}"
        ));
    }
    (min..=healthy)
        .rev()
        .find(|&w| cmd.world_usable(w))
        .ok_or_else(|| match cmd {
            RankCommand::Train(TrainCommand {
                hybrid_shard_size: Some(s),
                ..
            }) => format!(
                "no world size from --min-nproc {min} to the {healthy} slots left is a \
                 multiple of --shard-size {s} (--strategy hybrid)"
            ),
            _ => format!("no usable world size from {min} to {healthy}"),
        })
}

/// The `CUDA_VISIBLE_DEVICES` that maps LOCAL_RANK i to device slot `slots[i]`: entries of the
/// launcher's own `CUDA_VISIBLE_DEVICES` (`visible`) when it lists the slot, else the slot's
/// ordinal.
pub fn visible_devices(visible: Option<&str>, slots: &[usize]) -> String {
    let listed: Vec<&str> = visible
        .map(|v| {
            v.split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .collect()
        })
        .unwrap_or_default();
    slots
        .iter()
        .map(|&s| {
            listed
                .get(s)
                .map_or_else(|| s.to_string(), |d| d.to_string())
        })
        .collect::<Vec<_>>()
        .join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(a: &[&str]) -> Vec<String> {
        a.iter().map(|s| s.to_string()).collect()
    }

    fn fail(after_s: u64, cause: Cause) -> Failure {
        Failure {
            rank: 0,
            cause,
            after: Duration::from_secs(after_s),
        }
    }

    #[test]
    fn remove_flag_takes_both_spellings_and_leaves_lookalikes() {
        let mut a = v(&[
            "train",
            "--resume",
            "--resume-from",
            "20",
            "--resume-from=latest-valid",
            "--resumes",
            "--steps",
            "5",
        ]);
        remove_flag(&mut a, "--resume-from", true);
        assert_eq!(a, v(&["train", "--resume", "--resumes", "--steps", "5"]));
        remove_flag(&mut a, "--resume", false);
        assert_eq!(a, v(&["train", "--resumes", "--steps", "5"]));
    }

    #[test]
    fn train_commands_are_read_with_the_trainers_own_parser() {
        let c = RankCommand::read(
            false,
            &v(&[
                "train",
                "--ckpt-dir=ck",
                "--backend",
                "nccl",
                "--world-size=4",
                "--strategy",
                "hsdp",
                "--shard-size",
                "2",
            ]),
        );
        assert_eq!(
            c,
            RankCommand::Train(TrainCommand {
                ckpt_dir: Some(PathBuf::from("ck")),
                backend: BackendArg::Nccl,
                world_size_given: true,
                hybrid_shard_size: Some(2),
            })
        );
        assert!(c.world_usable(4) && c.world_usable(2) && !c.world_usable(3));
        assert_eq!(
            RankCommand::read(false, &v(&["plan", "--model", "tiny"])),
            RankCommand::OtherFsdp
        );
        assert_eq!(
            RankCommand::read(false, &v(&["train", "--no-such-flag"])),
            RankCommand::OtherFsdp
        );
        assert_eq!(
            RankCommand::read(true, &v(&["train"])),
            RankCommand::Program
        );
        assert!(!RankCommand::Program.exit_2_is_bad_input());
    }

    #[test]
    fn restarts_resume_from_the_newest_intact_checkpoint_once_one_was_saved() {
        let args = v(&["train", "--ckpt-dir", "ck", "--resume", "--steps", "9"]);
        let cmd = RankCommand::read(false, &args);
        // The first attempt, and a restart before any save, run the command as given.
        assert_eq!(
            command_for(&cmd, &args, 0, 1, true),
            (args.clone(), Resume::AsGiven)
        );
        assert_eq!(
            command_for(&cmd, &args, 1, 1, false),
            (args.clone(), Resume::AsGiven)
        );
        let (got, how) = command_for(&cmd, &args, 2, 1, true);
        assert_eq!(how, Resume::LatestValid);
        assert_eq!(
            got,
            v(&[
                "train",
                "--ckpt-dir",
                "ck",
                "--steps",
                "9",
                "--resume-from",
                "latest-valid"
            ])
        );
        // The rewritten line parses (no flag twice) and asks for latest-valid.
        let argv = std::iter::once("fsdp".to_string()).chain(got);
        let Ok(Cli {
            command: Command::Train(t),
        }) = Cli::try_parse_from(argv)
        else {
            panic!("rewritten command does not parse");
        };
        assert_eq!(t.ckpt.resume_from.as_deref(), Some("latest-valid"));
        assert!(!t.ckpt.resume);
        // Without --ckpt-dir nothing to resume from.
        let bare = v(&["train", "--steps", "9"]);
        let cmd = RankCommand::read(false, &bare);
        assert_eq!(
            command_for(&cmd, &bare, 1, 1, true),
            (bare, Resume::NoCheckpoints)
        );
    }

    #[test]
    fn an_elastic_restart_rewrites_the_nccl_world_size() {
        let args = v(&["train", "--backend", "nccl", "--world-size", "4"]);
        let cmd = RankCommand::read(false, &args);
        let (got, _) = command_for(&cmd, &args, 1, 3, false);
        assert_eq!(got, v(&["train", "--backend", "nccl", "--world-size", "3"]));
        // Without --world-size the trainer takes WORLD_SIZE from the environment.
        let args = v(&["train", "--backend", "nccl"]);
        let cmd = RankCommand::read(false, &args);
        assert_eq!(command_for(&cmd, &args, 1, 3, false).0, args);
    }

    #[test]
    fn a_slot_is_lost_after_two_consecutive_first_failures_at_start_up() {
        let mut h = SlotHealth::new(Duration::from_secs(60));
        let quick = fail(1, Cause::Exited(1));
        assert_eq!(h.record(&quick, 1), None);
        assert_eq!(h.record(&quick, 1), Some(1));
        // Another slot in between restarts the streak.
        assert_eq!(h.record(&quick, 2), None);
        assert_eq!(h.record(&quick, 0), None);
        assert_eq!(h.record(&quick, 2), None);
        assert_eq!(h.record(&quick, 2), Some(2));
        // A failure after the window is not the slot's.
        assert_eq!(h.record(&quick, 0), None);
        assert_eq!(h.record(&fail(61, Cause::Killed(9)), 0), None);
        assert_eq!(h.record(&quick, 0), None);
        // A process that cannot be started loses its slot at once.
        assert_eq!(
            h.record(&fail(0, Cause::NotStarted("EAGAIN".into())), 3),
            Some(3)
        );
    }

    #[test]
    fn the_elastic_world_is_the_largest_usable_one_from_min_up() {
        let hybrid = RankCommand::read(
            false,
            &v(&["train", "--strategy", "hybrid", "--shard-size", "2"]),
        );
        assert_eq!(elastic_world(&hybrid, 3, 2), Ok(2));
        assert_eq!(elastic_world(&RankCommand::Program, 3, 2), Ok(3));
        let e = elastic_world(&hybrid, 3, 3).unwrap_err();
        assert!(e.contains("multiple of --shard-size 2"), "{e}");
        let e = elastic_world(&RankCommand::Program, 1, 2).unwrap_err();
        assert!(e.contains("fewer than --min-nproc 2"), "{e}");
    }

    #[test]
    fn visible_devices_map_local_ranks_to_the_slots_left() {
        assert_eq!(visible_devices(None, &[0, 2, 3]), "0,2,3");
        assert_eq!(visible_devices(Some("4, 5,6,7"), &[0, 2]), "4,6");
        assert_eq!(visible_devices(Some("4"), &[0, 2]), "4,2");
    }
}
