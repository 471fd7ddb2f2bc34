//! `fsdp data`: prepare training data. `fsdp data tokenize --tokenizer tokenizer.json IN.txt...
//! -o OUT.bin` encodes UTF-8 texts with a Hugging Face tokenizer into a token file (format:
//! [`crate::data::tokens`]) that `fsdp train --data OUT.bin` reads window by window; each text
//! gets exactly the ids of the `tokenizers` library's `encode` of the whole text.

use super::CliError;
use crate::data::cuts::{self, CutPlan};
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
    /// Encode UTF-8 texts with a Hugging Face tokenizer.json into a token file for `fsdp train
    /// --data` (64-byte header, then u16 ids for vocabularies up to 65536, else u32): each text
    /// gets exactly the ids of the `tokenizers` library's `encode` of the whole text.
    Tokenize(TokenizeArgs),
}

/// Arguments of `fsdp data tokenize`.
#[derive(Debug, clap::Args)]
pub struct TokenizeArgs {
    /// The Hugging Face tokenizer (`tokenizer.json`, as saved by the `tokenizers` library).
    #[arg(long, value_name = "tokenizer.json")]
    pub tokenizer: PathBuf,
    /// The UTF-8 texts to encode, each one document: a file, a pipe or `/dev/stdin`, read as a
    /// stream. Each is encoded on its own, exactly as the `tokenizers` library's
    /// `encode(text)` encodes the whole text, and the token file holds them in order.
    #[arg(value_name = "IN.txt", required = true, num_args = 1..)]
    pub inputs: Vec<PathBuf>,
    /// The token file to write; it appears only when complete (written beside it under a
    /// temporary name, then renamed).
    #[arg(short, long, value_name = "OUT.bin")]
    pub output: PathBuf,
    /// Add the tokenizer's special tokens to each document, as `encode(text,
    /// add_special_tokens=True)` does (e.g. Llama 2's `<s>` before, BERT's `[CLS]` before and
    /// `[SEP]` after). Off by default: only the text's own tokens, one stream that training
    /// cuts into windows anywhere (a `<s>` mid-window would mark no real start); mark where
    /// documents end with `--eod-token`.
    #[arg(long)]
    pub add_special_tokens: bool,
    /// A token written after each document (its id, or its text, e.g. `</s>` or
    /// `<|endoftext|>`; a number is read as an id), so that a model sees where one document ends
    /// and the next begins. None by default.
    #[arg(long, value_name = "ID|TOKEN")]
    pub eod_token: Option<String>,
    /// Text bytes per piece: a text is encoded in pieces, cut at the first point after this
    /// many bytes where cutting provably gives the tokens of the whole text (for byte-level
    /// BPE after a newline between two non-space characters; for SentencePiece and WordPiece
    /// tokenizers before a space that follows a non-space, where no merge joins them). A
    /// tokenizer for which no such point is proven has each text encoded whole, in memory, with
    /// a note saying so.
    #[arg(long, default_value_t = tokens::DEFAULT_PIECE_BYTES, value_parser = super::checks::at_least_one)]
    pub piece_bytes: usize,
}

/// Runs `fsdp data`.
///
/// Errors: [`CliError::Usage`] (exit 2) for a missing input, a missing or invalid tokenizer,
/// an output whose directory does not exist, a text that is not UTF-8, an `--eod-token` the
/// tokenizer lacks, `--add-special-tokens` with a post-processor that does not frame the text; [`CliError::Failed`]
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
    let mut tokenizer = tokens::read_tokenizer(tok).map_err(|e| {
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
    let mut total = Some(0u64);
    for input in &a.inputs {
        match std::fs::metadata(input) {
            Err(e) => {
                let e = crate::cli::checks::io_words(&e);
                return usage(format!(
                    "{}: {e}; pass the text file to tokenize",
                    input.display()
                ));
            }
            Ok(m) if m.is_dir() => {
                return usage(format!(
                    "{} is a directory, not a text file",
                    input.display()
                ))
            }
            Ok(m) => {
                total = total
                    .zip(m.is_file().then_some(m.len()))
                    .map(|(t, n)| t + n)
            }
        }
    }
    check_output(&a.output)?;
    // Writing over a text (or the tokenizer) would destroy it: the output replaces its path
    // only once complete, so the same path would lose the input.
    let inputs = a.inputs.iter().map(|p| ("an input text", p));
    for (what, p) in inputs.chain([("the tokenizer", tok)]) {
        if same_file(p, &a.output) {
            return usage(format!(
                "-o {} is {what}: writing the token file there would replace it; choose another \
                 output path, e.g. -o {}",
                a.output.display(),
                a.output.with_extension("bin").display()
            ));
        }
    }
    let special = if a.add_special_tokens {
        Some(cuts::special_tokens(&tokenizer).map_err(|e| {
            CliError::Usage(format!(
                "--add-special-tokens: the tokenizer {}: {e}",
                tok.display()
            ))
        })?)
    } else {
        None
    };
    let eod = match &a.eod_token {
        Some(t) => Some(eod_id(&tokenizer, tok, t, vocab)?),
        None => None,
    };
    let sha = tokens::sha256_file(tok)
        .map_err(|e| CliError::Usage(format!("--tokenizer {}: {e}", tok.display())))?;
    for note in tokens::without_truncation_and_padding(&mut tokenizer) {
        crate::output::errln!("note: {note}");
    }
    let mut plan = CutPlan::new(&tokenizer);
    if let Some(reason) = plan.whole_reason() {
        crate::output::errln!(
            "note: cutting a text is not proven exact for the tokenizer {}: {reason}; each \
             input is encoded whole, in one piece held in memory (exact, as `tokenizers` encodes it)",
            tok.display()
        );
    }
    let mut writer = TokenWriter::create(&a.output, vocab, sha).map_err(|e| {
        CliError::Usage(format!(
            "-o {}: cannot create the token file: {e}",
            a.output.display()
        ))
    })?;
    let bar = progress_bar(total);
    let start = Instant::now();
    let (mut text_bytes, mut pieces) = (0u64, 0u64);
    for input in &a.inputs {
        let file = std::fs::File::open(input)
            .map_err(|e| CliError::Usage(format!("{}: {e}", input.display())))?;
        let mut reader = std::io::BufReader::with_capacity(1 << 20, file);
        let stats = tokens::encode_text(
            &mut reader,
            &tokenizer,
            &mut plan,
            special.as_ref(),
            &mut writer,
            a.piece_bytes,
            &mut |read| bar.set_position(text_bytes + read),
        );
        let stats = stats.map_err(|e| {
            let m = format!(
                "tokenizing {} into {}: {e} (nothing was written)",
                input.display(),
                a.output.display()
            );
            match e {
                tokens::EncodeError::NotUtf8 { .. } => CliError::Usage(m),
                _ => CliError::Failed(m),
            }
        })?;
        if let Some(id) = eod {
            writer.push(&[id]).map_err(|e| {
                CliError::Failed(format!(
                    "writing {}: {e} (nothing was written)",
                    a.output.display()
                ))
            })?;
        }
        text_bytes += stats.text_bytes;
        pieces += stats.pieces;
    }
    bar.finish_and_clear();
    let summary = writer.finish().map_err(|e| {
        CliError::Failed(format!(
            "writing {}: {e} (nothing was written)",
            a.output.display()
        ))
    })?;
    let g = fsdp_types::group_thousands;
    let from = match &a.inputs[..] {
        [one] => one.display().to_string(),
        many => format!("{} documents", many.len()),
    };
    let line = format!(
        "wrote {}: {} tokens, vocabulary {}, {}, {} bytes, from {} bytes of {from} ({} piece{}) in {:.2} s",
        a.output.display(),
        g(summary.header.count),
        g(summary.header.vocab_size),
        summary.header.dtype,
        g(summary.bytes),
        g(text_bytes),
        g(pieces),
        if pieces == 1 { "" } else { "s" },
        start.elapsed().as_secs_f64()
    );
    // The token file is written: a closed stdout (`| head`) loses only this line.
    crate::output::outln!("{line}");
    Ok(())
}

/// The id `--eod-token` names: a number below the vocabulary size, or a token's text.
fn eod_id(
    tokenizer: &tokenizers::Tokenizer,
    path: &Path,
    token: &str,
    vocab: u64,
) -> Result<u32, CliError> {
    if let Ok(id) = token.parse::<u64>() {
        return match u32::try_from(id) {
            Ok(id) if (id as u64) < vocab => Ok(id),
            _ => Err(CliError::Usage(format!(
                "--eod-token {id} is not an id of the tokenizer {} (its vocabulary has {vocab} ids, 0 to {})",
                path.display(),
                vocab - 1
            ))),
        };
    }
    tokenizer.token_to_id(token).ok_or_else(|| {
        let mut special: Vec<(u32, String)> = tokenizer
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, t)| t.special)
            .map(|(id, t)| (id, t.content))
            .collect();
        special.sort();
        let list: Vec<String> = special
            .iter()
            .take(8)
            .map(|(id, t)| format!("{t} ({id})"))
            .collect();
        CliError::Usage(format!(
            "--eod-token {token:?} is not a token of the tokenizer {}; pass a token it has or its id{}",
            path.display(),
            if list.is_empty() {
                String::new()
            } else {
                format!(", e.g. one of its special tokens: {}", list.join(", "))
            }
        ))
    })
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
