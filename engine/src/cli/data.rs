//! `fsdp data`: prepare training data. `fsdp data tokenize --tokenizer tokenizer.json IN.txt
//! -o OUT.bin` encodes a UTF-8 text with a Hugging Face tokenizer into a token file
//! (format: [`crate::data::tokens`]) that `fsdp train --data OUT.bin` reads window by window.

use super::CliError;
use crate::data::tokens::{self, TokenWriter};
use indicatif::{ProgressBar, ProgressStyle};
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Arguments of `fsdp data`.
#[derive(Debug, clap::Args)]
pub struct DataArgs {
    /// The data command.
    #[command(subcommand)]
    pub command: DataCommand,
}

/// The `fsdp data` commands.
#[derive(Debug, clap::Subcommand)]
pub enum DataCommand {
    /// Encode a UTF-8 text with a Hugging Face tokenizer.json into a token file for `fsdp train
    /// --data` (64-byte header, then u16 ids for vocabularies up to 65536, else u32).
    Tokenize(TokenizeArgs),
}

/// Arguments of `fsdp data tokenize`.
#[derive(Debug, clap::Args)]
pub struct TokenizeArgs {
    /// The Hugging Face tokenizer (`tokenizer.json`, as saved by the `tokenizers` library).
    #[arg(long, value_name = "tokenizer.json")]
    pub tokenizer: PathBuf,
    /// The UTF-8 text to encode: a file, a pipe or `/dev/stdin`, read as a stream.
    #[arg(value_name = "IN.txt")]
    pub input: PathBuf,
    /// The token file to write; it appears only when complete (written beside it under a
    /// temporary name, then renamed).
    #[arg(short, long, value_name = "OUT.bin")]
    pub output: PathBuf,
    /// Text bytes per piece: the text is encoded in pieces of whole lines, each on its own, cut
    /// once a piece holds this many bytes after a newline with a non-whitespace character on
    /// either side (where byte-level BPE tokenizers such as GPT-2's and Llama 3's split
    /// anyway); after any newline once it holds 16 times as many.
    #[arg(long, default_value_t = tokens::DEFAULT_PIECE_BYTES, value_parser = super::checks::at_least_one)]
    pub piece_bytes: usize,
}

/// Runs `fsdp data`.
///
/// Errors: [`CliError::Usage`] (exit 2) for a missing input, a missing or invalid tokenizer,
/// an output whose directory does not exist, a text that is not UTF-8; [`CliError::Failed`]
/// (exit 1) when reading, encoding or writing fails part-way (no output file is left).
pub fn run(a: DataArgs) -> Result<(), CliError> {
    match a.command {
        DataCommand::Tokenize(t) => tokenize(t),
    }
}

fn tokenize(a: TokenizeArgs) -> Result<(), CliError> {
    let usage = |m: String| Err(CliError::Usage(m));
    let tok = &a.tokenizer;
    match std::fs::metadata(tok) {
        Err(e) => {
            let e = crate::cli::checks::io_words(&e);
            return usage(format!(
                "--tokenizer {}: {e}; pass the tokenizer.json of a Hugging Face tokenizer (saved by `tokenizers`, e.g. from a model repository)",
                tok.display()
            ));
        }
        Ok(m) if m.is_dir() && tok.join("tokenizer.json").is_file() => {
            return usage(format!(
                "--tokenizer {} is a directory; pass the file: --tokenizer {}",
                tok.display(),
                tok.join("tokenizer.json").display()
            ))
        }
        Ok(m) if m.is_dir() => {
            return usage(format!(
                "--tokenizer {} is a directory, not a tokenizer.json file",
                tok.display()
            ))
        }
        Ok(_) => {}
    }
    let tokenizer = tokenizers::Tokenizer::from_file(tok).map_err(|e| {
        CliError::Usage(format!(
            "--tokenizer {} is not a Hugging Face tokenizer file: {e}; pass a tokenizer.json saved by the `tokenizers` library",
            tok.display()
        ))
    })?;
    let vocab = tokenizer.get_vocab_size(true) as u64;
    if vocab == 0 {
        return usage(format!(
            "--tokenizer {}: the tokenizer has an empty vocabulary",
            tok.display()
        ));
    }
    let input_meta = match std::fs::metadata(&a.input) {
        Err(e) => {
            let e = crate::cli::checks::io_words(&e);
            return usage(format!(
                "{}: {e}; pass the text file to tokenize",
                a.input.display()
            ));
        }
        Ok(m) if m.is_dir() => {
            return usage(format!(
                "{} is a directory, not a text file",
                a.input.display()
            ))
        }
        Ok(m) => m,
    };
    check_output(&a.output)?;
    // Writing over the text (or the tokenizer) would destroy it: the output replaces its path
    // only once complete, so the same path would lose the input.
    for (what, p) in [("the input text", &a.input), ("the tokenizer", tok)] {
        if same_file(p, &a.output) {
            return usage(format!(
                "-o {} is {what}: writing the token file there would replace it; choose another \
                 output path, e.g. -o {}",
                a.output.display(),
                a.output.with_extension("bin").display()
            ));
        }
    }
    let sha = tokens::sha256_file(tok)
        .map_err(|e| CliError::Usage(format!("--tokenizer {}: {e}", tok.display())))?;
    let input = std::fs::File::open(&a.input)
        .map_err(|e| CliError::Usage(format!("{}: {e}", a.input.display())))?;
    let mut writer = TokenWriter::create(&a.output, vocab, sha).map_err(|e| {
        CliError::Usage(format!(
            "-o {}: cannot create the token file: {e}",
            a.output.display()
        ))
    })?;
    let bar = progress_bar(input_meta.is_file().then_some(input_meta.len()));
    let start = Instant::now();
    let mut reader = std::io::BufReader::with_capacity(1 << 20, input);
    let stats = tokens::encode_text(
        &mut reader,
        &tokenizer,
        &mut writer,
        a.piece_bytes,
        &mut |read| bar.set_position(read),
    );
    bar.finish_and_clear();
    let stats = stats.map_err(|e| {
        let m = format!(
            "tokenizing {} into {}: {e} (nothing was written)",
            a.input.display(),
            a.output.display()
        );
        match e {
            tokens::EncodeError::NotUtf8 { .. } => CliError::Usage(m),
            _ => CliError::Failed(m),
        }
    })?;
    let summary = writer.finish().map_err(|e| {
        CliError::Failed(format!(
            "writing {}: {e} (nothing was written)",
            a.output.display()
        ))
    })?;
    let g = fsdp_types::group_thousands;
    let line = format!(
        "wrote {}: {} tokens, vocabulary {}, {}, {} bytes, from {} bytes of {} ({} pieces) in {:.2} s",
        a.output.display(),
        g(summary.header.count),
        g(summary.header.vocab_size),
        summary.header.dtype,
        g(summary.bytes),
        g(stats.text_bytes),
        a.input.display(),
        g(stats.pieces),
        start.elapsed().as_secs_f64()
    );
    use std::io::Write as _;
    if let Err(e) = writeln!(std::io::stdout().lock(), "{line}") {
        if e.kind() == std::io::ErrorKind::BrokenPipe {
            std::process::exit(141);
        }
    }
    Ok(())
}

/// Whether `a` and `b` name the same existing file (same device and inode: links and relative
/// paths included).
fn same_file(a: &Path, b: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (std::fs::metadata(a), std::fs::metadata(b)) {
        (Ok(x), Ok(y)) => x.dev() == y.dev() && x.ino() == y.ino(),
        _ => false,
    }
}

/// The output's directory must exist and the output may not be a directory.
fn check_output(out: &Path) -> Result<(), CliError> {
    let parent = out
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    if !parent.is_dir() {
        return Err(CliError::Usage(format!(
            "-o {}: the directory {} does not exist; create it first (mkdir -p {})",
            out.display(),
            parent.display(),
            parent.display()
        )));
    }
    if out.is_dir() {
        return Err(CliError::Usage(format!(
            "-o {} is a directory; name the token file, e.g. -o {}",
            out.display(),
            out.join("tokens.bin").display()
        )));
    }
    Ok(())
}

/// A bar of text bytes read on stderr (a spinner for a stream of unknown length); hidden when
/// stderr is not a terminal.
fn progress_bar(len: Option<u64>) -> ProgressBar {
    use std::io::IsTerminal as _;
    if !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let (bar, template) = match len {
        Some(n) => (
            ProgressBar::new(n),
            "{bar:30} {bytes}/{total_bytes} [{elapsed_precise}<{eta_precise}] {bytes_per_sec}",
        ),
        None => (
            ProgressBar::new_spinner(),
            "{spinner} {bytes} [{elapsed_precise}] {bytes_per_sec}",
        ),
    };
    if let Ok(style) = ProgressStyle::with_template(template) {
        bar.set_style(style);
    }
    bar
}
