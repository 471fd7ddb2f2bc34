//! Where a text may be cut so that encoding it piece by piece gives exactly the tokens of
//! encoding it whole with the Hugging Face `tokenizers` library.
//!
//! # The pipeline and what a cut can change
//!
//! `Tokenizer::encode(text)` runs, in order ([tokenizers' pipeline]):
//!
//! 1. the added tokens (special tokens included) are found in the text, which they cut into
//!    *segments*;
//! 2. the normalizer rewrites each segment;
//! 3. the pre-tokenizer cuts each normalized segment into *words*;
//! 4. the model encodes each word on its own (BPE merges, a Unigram lattice, WordPiece);
//! 5. the post-processor adds special tokens (only with `add_special_tokens`).
//!
//! A cut between the characters `l` and `r` of a text `A l | r B` is *exact* when
//! `encode(A l r B) = encode(A l) ++ rest(r B)`, where `rest(r B)` depends on `r B` alone. Two
//! things can break that, and a [`CutPlan`] excludes both:
//!
//! - **Joins across the cut**: an added token, a normalizer pattern, a pre-tokenizer word or a
//!   model token spanning the cut. The plan accepts a cut only where every stage provably keeps
//!   the two sides apart (the rules below).
//! - **Start-of-text effects**: a SentencePiece `Prepend("▁")` normalizer, a `Metaspace`
//!   pre-tokenizer's prepended `▁`, or `ByteLevel`'s `add_prefix_space` change only the start of
//!   the text (or of a segment). A piece after a cut is therefore never encoded as a text of its
//!   own: it is encoded behind its *context*, the characters just before the cut that the rule
//!   inspected (`ctx`), as `encode(ctx r B)`, and the tokens of `encode(ctx)` are dropped from
//!   its front (checked to be there, id for id). The start effects land in the context; the cut
//!   being exact in `ctx r B` as in the whole text, what remains is `rest(r B)`.
//!
//! # The rules
//!
//! Pre-tokenizers that split with the GPT-2, Llama 3 or Qwen2 regular expression (`ByteLevel`
//! with `use_regex`, or `Split` with one of those patterns, as GPT-2, Llama 3 and Qwen2 ship)
//! use [`CutRule::AfterNewline`]: a cut after a `\n` that has a non-whitespace character on
//! either side (`x\n|y`). Each of the three patterns ends its word at that `\n` (`\s*[\r\n]+`,
//! `\s+`, or `[^\s\p{L}\p{N}]+[\r\n]*` when `x` is punctuation) and no alternative starts a word
//! with a newline followed by a non-space; the patterns have no look-behind, and their only
//! look-ahead (`\s+(?!\S)`) cannot reach over `x`. Other patterns are not analysed.
//!
//! Every other supported tokenizer uses [`CutRule::BeforeSpace`]: a cut before a space that
//! follows a non-whitespace character (`l| …`). It is a word boundary for `Metaspace` with
//! `split` (a word starts at each `▁`, the space replaced), `WhitespaceSplit`, `Whitespace` and
//! `BertPreTokenizer` (the space is dropped between words). Where the pre-tokenizer leaves the
//! whole segment one word (no pre-tokenizer, as Llama 2 ships; `Metaspace` without `split`, as
//! Mistral ships), the model must keep the sides apart itself: only BPE without dropout,
//! `continuing_subword_prefix`, `end_of_word_suffix` and `ignore_merges` is accepted, and only
//! where `l` and `r` (normalized) are tokens of the vocabulary and no merge `(a, b)` has `a`
//! ending in `l` and `b` starting with `r`: the first merge across the cut would have to be
//! such a pair (merged tokens are the concatenations of their parts), so none happens, and the
//! merges on each side are chosen in the same order as alone (by rank, then position). A
//! Unigram lattice over a whole segment is not cut: its scores are floating-point sums, so a
//! cut could change which of two near-equal segmentations wins.
//!
//! Normalizers accepted: `Lowercase`, `StripAccents`, `Nmt`, `ByteLevel`, `BertNormalizer`,
//! `Replace` of a single character (each acts on one character at a time), `Prepend` (a start
//! effect), and `NFC`/`NFD`/`NFKC`/`NFKD` (Unicode normalization never composes or reorders
//! across a `\n` or before an ASCII character such as the space; with `NFKC`/`NFKD` the character
//! before the cut must be ASCII, since a compatibility mapping can change whether it is a
//! space). The characters beside the cut are normalized on their own to check the rules.
//!
//! Added tokens: a cut is refused where an added token's content contains `l r`, ends with `l`
//! or starts with `r` (raw or normalized), or, for `x\n|y`, ends with `x` and takes the
//! whitespace after it (`rstrip`), so that no added token spans or touches the cut (touching
//! would start a segment there, with its start effects, `lstrip` and `rstrip`).
//!
//! A tokenizer with any other component (a `Strip` or `Precompiled` normalizer, a `Replace`
//! pattern of several characters or a regular expression, other pre-tokenizers or `Split`
//! patterns, a model that cannot be cut within a word when the pre-tokenizer does not cut
//! there, BPE dropout) gets [`CutPlan::whole_reason`]: its texts are encoded whole, in one
//! piece, which is exact by definition.
//!
//! [tokenizers' pipeline]: https://huggingface.co/docs/tokenizers/pipeline

use serde_json::Value;
use std::collections::{HashMap, HashSet};
use tokenizers::normalizers::NormalizerWrapper;
use tokenizers::{NormalizedString, Normalizer as _, Tokenizer};

/// The GPT-2 word pattern that `ByteLevel` with `use_regex` applies.
pub const GPT2_PATTERN: &str =
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";

/// The Llama 3 pre-tokenizer `Split` pattern (as in Meta-Llama-3's `tokenizer.json`).
pub const LLAMA3_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The Qwen2 pre-tokenizer `Split` pattern (as in Qwen2's `tokenizer.json`).
pub const QWEN2_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Where a text may be cut (see the module docs for why each is exact).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CutRule {
    /// After a `\n` with a non-whitespace character on either side: `x\n|y`; context `x\n`.
    AfterNewline,
    /// Before a space that follows a non-whitespace character: `l| …`; context `l`.
    BeforeSpace,
}

/// How far Unicode normalization reaches in a normalizer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Nf {
    None,
    /// NFC or NFD (canonical): never turns a non-space into a space.
    Canonical,
    /// NFKC or NFKD: may map a character to one starting or ending with a space.
    Compat,
}

/// One pre-tokenizer step, as far as cutting is concerned.
#[derive(Debug, Clone, PartialEq)]
enum Step {
    /// A split by one of the known word patterns (GPT-2, Llama 3, Qwen2).
    KnownRegex,
    /// `ByteLevel` without its regex: maps bytes to characters, no split.
    ByteMap,
    /// Splits at (and drops) whitespace: `Whitespace`, `WhitespaceSplit`, `BertPreTokenizer`.
    Whitespace,
    /// `Metaspace`: replaces spaces with `replacement`; `split` starts a word at each one.
    Metaspace { replacement: char, split: bool },
}

/// BPE merges, for cuts inside a word.
#[derive(Debug)]
struct Merges {
    vocab: HashSet<String>,
    pairs: Vec<(String, String)>,
    /// For a right character `r`: the last characters of every merge's left part whose right
    /// part starts with `r` (filled on demand).
    joins: HashMap<char, HashSet<char>>,
}

impl Merges {
    /// Whether no merge can join a word part ending in `l` with one starting with `r`.
    fn separable(&mut self, l: char, r: char) -> bool {
        let mut buf = [0u8; 4];
        if !self.vocab.contains(l.encode_utf8(&mut buf) as &str)
            || !self.vocab.contains(r.encode_utf8(&mut buf) as &str)
        {
            return false;
        }
        let pairs = &self.pairs;
        let joins = self.joins.entry(r).or_insert_with(|| {
            pairs
                .iter()
                .filter(|(_, b)| b.starts_with(r))
                .filter_map(|(a, _)| a.chars().next_back())
                .collect()
        });
        !joins.contains(&l)
    }
}

/// Where a tokenizer's texts may be cut, found by [`CutPlan::new`] from its normalizer,
/// pre-tokenizer, model and added tokens (see the module docs).
#[derive(Debug)]
pub struct CutPlan {
    rule: Option<CutRule>,
    whole_reason: Option<String>,
    normalizer: Option<NormalizerWrapper>,
    nf: Nf,
    steps: Vec<Step>,
    merges: Option<Merges>,
    /// Each added token: its content, its normalized content (empty unless it is matched
    /// normalized) and whether it takes the whitespace after it (`rstrip`).
    added: Vec<(String, String, bool)>,
    verdicts: HashMap<(char, char, char), bool>,
}

/// A cut found by [`CutPlan::find_cut`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cut {
    /// Byte position of the cut: the left piece is `text[..at]`.
    pub at: usize,
    /// Bytes before `at` that the next piece is encoded behind (its context).
    pub context: usize,
}

impl CutPlan {
    /// Analyses `tokenizer`. Never fails: what cannot be proven exact is encoded whole
    /// ([`CutPlan::whole_reason`] says why).
    pub fn new(tokenizer: &Tokenizer) -> Self {
        let mut plan = CutPlan {
            rule: None,
            whole_reason: None,
            normalizer: tokenizer.get_normalizer().cloned(),
            nf: Nf::None,
            steps: Vec::new(),
            merges: None,
            added: Vec::new(),
            verdicts: HashMap::new(),
        };
        if let Err(reason) = plan.analyse(tokenizer) {
            plan.rule = None;
            plan.whole_reason = Some(reason);
        }
        plan
    }

    /// A plan that never cuts (every text is one piece).
    pub fn whole(reason: impl Into<String>) -> Self {
        CutPlan {
            rule: None,
            whole_reason: Some(reason.into()),
            normalizer: None,
            nf: Nf::None,
            steps: Vec::new(),
            merges: None,
            added: Vec::new(),
            verdicts: HashMap::new(),
        }
    }

    /// The rule cuts are found by; `None` when texts are encoded whole.
    pub fn rule(&self) -> Option<CutRule> {
        self.rule
    }

    /// Why texts are encoded whole (`None` when they are cut).
    pub fn whole_reason(&self) -> Option<&str> {
        self.whole_reason.as_deref()
    }

    fn analyse(&mut self, tokenizer: &Tokenizer) -> Result<(), String> {
        let json = |what: &str, v: Result<Value, serde_json::Error>| {
            v.map_err(|e| format!("its {what} could not be read back ({e})"))
        };
        if let Some(n) = tokenizer.get_normalizer() {
            let v = json("normalizer", serde_json::to_value(n))?;
            self.nf = normalizer_reach(&v)?;
            // The characters beside a cut are normalized as the middle of a text: without the
            // start effect of `Prepend`.
            self.normalizer = match without_prepend(&v) {
                Some(v) => Some(
                    serde_json::from_value(v)
                        .map_err(|e| format!("its normalizer could not be read back ({e})"))?,
                ),
                None => None,
            };
        }
        if let Some(p) = tokenizer.get_pre_tokenizer() {
            let v = json("pre-tokenizer", serde_json::to_value(p))?;
            pre_tokenizer_steps(&v, &mut self.steps)?;
        }
        let rule = if self.steps.contains(&Step::KnownRegex) {
            CutRule::AfterNewline
        } else {
            CutRule::BeforeSpace
        };
        // `tokenizers` writes a vocabulary out by walking every id up to the largest, listing
        // the missing ones: a single id near u32::MAX would take minutes and gigabytes.
        let vocab = tokenizer.get_vocab(false);
        let largest = vocab.values().copied().max().unwrap_or(0);
        if largest as usize >= vocab.len() {
            return Err(format!(
                "its vocabulary has gaps (largest id {largest} for {} tokens)",
                vocab.len()
            ));
        }
        let model = json("model", serde_json::to_value(tokenizer.get_model()))?;
        let kind = model["type"].as_str().unwrap_or("unknown").to_string();
        if kind == "BPE" && model["dropout"].as_f64().is_some_and(|p| p > 0.0) {
            return Err("its BPE model has dropout, so its encoding is random".into());
        }
        let splits_words = self.steps.iter().any(|s| match (rule, s) {
            (CutRule::AfterNewline, Step::KnownRegex | Step::Whitespace) => true,
            (CutRule::BeforeSpace, Step::Whitespace) => true,
            (CutRule::BeforeSpace, Step::Metaspace { split, .. }) => *split,
            _ => false,
        });
        let mergeable = kind == "BPE"
            && model["continuing_subword_prefix"].is_null()
            && model["end_of_word_suffix"].is_null()
            && !model["ignore_merges"].as_bool().unwrap_or(false);
        if mergeable {
            self.merges = Some(bpe_merges(&model)?);
        } else if !splits_words {
            return Err(format!(
                "its pre-tokenizer leaves a text (between added tokens) one word, and its {kind} \
                 model cannot be proven to encode a word cut in two as the whole word"
            ));
        }
        self.added = tokenizer
            .get_added_tokens_decoder()
            .into_values()
            .map(|t| {
                let n = if t.normalized {
                    self.normalize(&t.content).unwrap_or_default()
                } else {
                    String::new()
                };
                (t.content, n, t.rstrip)
            })
            .collect();
        self.rule = Some(rule);
        Ok(())
    }

    fn normalize(&self, s: &str) -> Option<String> {
        let Some(n) = &self.normalizer else {
            return Some(s.to_string());
        };
        let mut ns = NormalizedString::from(s);
        n.normalize(&mut ns).ok()?;
        Some(ns.get().to_string())
    }

    /// The first exact cut at a byte position `>= from` (and `>= 1`) of `text`, where the cut
    /// leaves at least one byte on its right. Positions whose characters are not all in `text`
    /// or not valid UTF-8 are skipped. Always `None` when texts are encoded whole.
    pub fn find_cut(&mut self, text: &[u8], from: usize) -> Option<Cut> {
        let rule = self.rule?;
        let from = from.max(1);
        let mut p = from;
        while p < text.len() {
            let found = match rule {
                CutRule::AfterNewline => text[p - 1] == b'\n' && p >= 2,
                CutRule::BeforeSpace => text[p] == b' ',
            };
            if found {
                if let Some(cut) = self.check(rule, text, p) {
                    return Some(cut);
                }
            }
            p += 1;
        }
        None
    }

    /// Whether the candidate position `p` of `rule` is an exact cut.
    fn check(&mut self, rule: CutRule, text: &[u8], p: usize) -> Option<Cut> {
        let (x, left_len) = match rule {
            CutRule::AfterNewline => char_before(&text[..p - 1])?,
            CutRule::BeforeSpace => char_before(&text[..p])?,
        };
        let (y, _) = char_at(&text[p..])?;
        let key = (
            x,
            if rule == CutRule::AfterNewline {
                '\n'
            } else {
                ' '
            },
            y,
        );
        let ok = match self.verdicts.get(&key) {
            Some(&v) => v,
            None => {
                let v = self.exact(rule, x, y);
                self.verdicts.insert(key, v);
                v
            }
        };
        ok.then_some(Cut {
            at: p,
            context: left_len + usize::from(rule == CutRule::AfterNewline),
        })
    }

    /// The rules of the module docs for a cut `x\n|y` ([`CutRule::AfterNewline`]) or `x| y`
    /// ([`CutRule::BeforeSpace`], `y` = the space).
    fn exact(&mut self, rule: CutRule, x: char, y: char) -> bool {
        if !surely_not_space(x) || (rule == CutRule::AfterNewline && !surely_not_space(y)) {
            return false;
        }
        if self.nf == Nf::Compat && !x.is_ascii() {
            return false;
        }
        // The raw characters on either side of the cut.
        let (l, r) = match rule {
            CutRule::AfterNewline => ('\n', y),
            CutRule::BeforeSpace => (x, ' '),
        };
        let (Some(nx), Some(nl), Some(nr)) = (
            self.normalize(x.encode_utf8(&mut [0; 4])),
            self.normalize(l.encode_utf8(&mut [0; 4])),
            self.normalize(r.encode_utf8(&mut [0; 4])),
        ) else {
            return false;
        };
        // `left` ends at the cut, `right` starts there (normalized).
        let mut left = match rule {
            CutRule::AfterNewline => format!("{nx}{nl}"),
            CutRule::BeforeSpace => nl,
        };
        let mut right = nr;
        let (Some(nlc), Some(nrc)) = (left.chars().next_back(), right.chars().next()) else {
            return false;
        };
        for (content, normalized, rstrip) in &self.added {
            if touches(content, l, r) || (!normalized.is_empty() && touches(normalized, nlc, nrc)) {
                return false;
            }
            // `x\n|y`: a token ending at `x` that takes the whitespace after it would end at
            // the cut, and start a segment there.
            let ends_at_x = content.ends_with(x)
                || (!normalized.is_empty()
                    && nx
                        .chars()
                        .next_back()
                        .is_some_and(|c| normalized.ends_with(c)));
            if rule == CutRule::AfterNewline && *rstrip && ends_at_x {
                return false;
            }
        }
        for step in &self.steps {
            let (Some(lc), Some(rc)) = (left.chars().next_back(), right.chars().next()) else {
                return false;
            };
            let apart = match step {
                Step::KnownRegex => {
                    // `x\n|y` with x, y not whitespace after normalization; any other place
                    // is not analysed.
                    let mut tail = left.chars().rev();
                    let (nl, before) = (tail.next(), tail.next());
                    if !(rule == CutRule::AfterNewline
                        && nl == Some('\n')
                        && before.is_some_and(surely_not_space)
                        && surely_not_space(rc))
                    {
                        return false;
                    }
                    true
                }
                Step::ByteMap => return false,
                Step::Whitespace => {
                    if !(surely_space(lc) || surely_space(rc)) {
                        return false;
                    }
                    true
                }
                Step::Metaspace { replacement, split } => {
                    left = left.replace(' ', replacement.encode_utf8(&mut [0; 4]));
                    right = right.replace(' ', replacement.encode_utf8(&mut [0; 4]));
                    *split && right.starts_with(*replacement)
                }
            };
            // Later steps only cut the words further.
            if apart {
                return true;
            }
        }
        // One word across the cut: the model must keep it apart.
        if self.nf != Nf::None && !x.is_ascii() {
            return false;
        }
        match (
            &mut self.merges,
            left.chars().next_back(),
            right.chars().next(),
        ) {
            (Some(m), Some(lc), Some(rc)) => m.separable(lc, rc),
            _ => false,
        }
    }
}

/// Whether an added token's `content` could span or touch a cut between `l` and `r`.
fn touches(content: &str, l: char, r: char) -> bool {
    let mut pair = String::with_capacity(8);
    pair.push(l);
    pair.push(r);
    content.contains(&pair) || content.ends_with(l) || content.starts_with(r)
}

/// Not whitespace by any definition a tokenizer uses (Unicode `White_Space`, the regular
/// expressions' `\s`, Python's `isspace`): also excludes control characters and the zero-width
/// and byte-order marks.
fn surely_not_space(c: char) -> bool {
    !c.is_whitespace()
        && !c.is_control()
        && !matches!(
            c,
            '\u{180E}' | '\u{200B}'..='\u{200D}' | '\u{2060}' | '\u{FEFF}'
        )
}

/// Whitespace by every definition a tokenizer uses.
fn surely_space(c: char) -> bool {
    matches!(c, ' ' | '\n' | '\t' | '\r')
}

/// The character ending `b` and its length in bytes, if `b` ends with a whole valid one.
fn char_before(b: &[u8]) -> Option<(char, usize)> {
    let start = (b.len().saturating_sub(4)..b.len())
        .rev()
        .find(|&i| b[i] & 0xC0 != 0x80)?;
    let s = std::str::from_utf8(&b[start..]).ok()?;
    let mut cs = s.chars();
    let c = cs.next()?;
    cs.next().is_none().then_some((c, s.len()))
}

/// The character starting `b` and its length in bytes, if whole and valid.
fn char_at(b: &[u8]) -> Option<(char, usize)> {
    let len = match *b.first()? {
        x if x < 0x80 => 1,
        x if x >= 0xF0 => 4,
        x if x >= 0xE0 => 3,
        _ => 2,
    };
    let s = std::str::from_utf8(b.get(..len)?).ok()?;
    s.chars().next().map(|c| (c, len))
}

/// How far Unicode normalization reaches in the serialized normalizer `v`, or why it is not
/// accepted.
fn normalizer_reach(v: &Value) -> Result<Nf, String> {
    let kind = v["type"].as_str().unwrap_or("unknown");
    Ok(match kind {
        "Sequence" => {
            let mut nf = Nf::None;
            for n in v["normalizers"].as_array().into_iter().flatten() {
                nf = nf.max(normalizer_reach(n)?);
            }
            nf
        }
        "NFC" | "NFD" => Nf::Canonical,
        "NFKC" | "NFKD" => Nf::Compat,
        "Lowercase" | "StripAccents" | "Nmt" | "ByteLevel" | "Prepend" => Nf::None,
        "BertNormalizer" => {
            let lowercase = v["lowercase"].as_bool().unwrap_or(true);
            if v["strip_accents"].as_bool().unwrap_or(lowercase) {
                Nf::Canonical
            } else {
                Nf::None
            }
        }
        "Replace" => match v["pattern"].get("String").and_then(Value::as_str) {
            Some(s) if s.chars().count() == 1 => Nf::None,
            _ => {
                return Err(format!(
                    "its normalizer Replace has the pattern {}, which could match across a cut",
                    v["pattern"]
                ))
            }
        },
        other => {
            return Err(format!(
                "its normalizer {other} is not one whose cuts are proven exact"
            ))
        }
    })
}

/// The serialized normalizer `v` without its `Prepend` components (`None`: nothing is left).
fn without_prepend(v: &Value) -> Option<Value> {
    match v["type"].as_str() {
        Some("Prepend") => None,
        Some("Sequence") => {
            let rest: Vec<Value> = v["normalizers"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(without_prepend)
                .collect();
            let mut v = v.clone();
            v["normalizers"] = Value::Array(rest);
            Some(v)
        }
        _ => Some(v.clone()),
    }
}

/// The steps of the serialized pre-tokenizer `v`, or why it is not accepted.
fn pre_tokenizer_steps(v: &Value, steps: &mut Vec<Step>) -> Result<(), String> {
    let kind = v["type"].as_str().unwrap_or("unknown");
    match kind {
        "Sequence" => {
            for p in v["pretokenizers"].as_array().into_iter().flatten() {
                pre_tokenizer_steps(p, steps)?;
            }
        }
        "ByteLevel" => steps.push(if v["use_regex"].as_bool().unwrap_or(true) {
            Step::KnownRegex
        } else {
            Step::ByteMap
        }),
        "Split" => {
            let pattern = v["pattern"]
                .get("Regex")
                .or_else(|| v["pattern"].get("String"))
                .and_then(Value::as_str)
                .unwrap_or("");
            let known = v["pattern"].get("Regex").is_some()
                && [GPT2_PATTERN, LLAMA3_PATTERN, QWEN2_PATTERN].contains(&pattern)
                && v["behavior"].as_str() == Some("Isolated")
                && !v["invert"].as_bool().unwrap_or(false);
            if !known {
                return Err(format!(
                    "its pre-tokenizer Split has the pattern {} (behavior {}), not one of the \
                     GPT-2, Llama 3 or Qwen2 patterns whose cuts are proven exact",
                    v["pattern"], v["behavior"]
                ));
            }
            steps.push(Step::KnownRegex);
        }
        "Whitespace" | "WhitespaceSplit" | "BertPreTokenizer" => steps.push(Step::Whitespace),
        "Metaspace" => {
            let replacement = v["replacement"]
                .as_str()
                .and_then(|s| {
                    let mut cs = s.chars();
                    cs.next().filter(|_| cs.next().is_none())
                })
                .ok_or_else(|| {
                    format!(
                        "its Metaspace replacement {} is not one character",
                        v["replacement"]
                    )
                })?;
            steps.push(Step::Metaspace {
                replacement,
                split: v["split"].as_bool().unwrap_or(true),
            });
        }
        other => {
            return Err(format!(
                "its pre-tokenizer {other} is not one whose cuts are proven exact"
            ))
        }
    }
    Ok(())
}

/// The vocabulary and merges of the serialized BPE model `v`.
fn bpe_merges(v: &Value) -> Result<Merges, String> {
    let vocab = v["vocab"]
        .as_object()
        .ok_or("its BPE model has no vocabulary")?
        .keys()
        .cloned()
        .collect();
    let mut pairs = Vec::new();
    for m in v["merges"].as_array().into_iter().flatten() {
        let pair = match m {
            Value::Array(a) if a.len() == 2 => a[0].as_str().zip(a[1].as_str()),
            Value::String(s) => s.split_once(' '),
            _ => None,
        };
        let (a, b) = pair.ok_or_else(|| format!("its BPE merge {m} is not a pair"))?;
        pairs.push((a.to_string(), b.to_string()));
    }
    Ok(Merges {
        vocab,
        pairs,
        joins: HashMap::new(),
    })
}

/// The ids `tokenizer.encode(text, add_special_tokens = true)` puts before and after the ids of
/// `encode(text, false)`: its post-processor applied to a one-token encoding (every
/// post-processor of the `tokenizers` library inserts the text's ids whole, once, for a single
/// sequence). E.g. Llama 2: `([1], [])` (`<s>`); BERT: `([CLS], [SEP])`; GPT-2: `([], [])`.
///
/// Errors: the post-processor's own, or a post-processor that does not keep the text's ids
/// together once (named in the message).
pub fn special_tokens(tokenizer: &Tokenizer) -> Result<(Vec<u32>, Vec<u32>), String> {
    use tokenizers::{Encoding, Token};
    const PROBE: u32 = 0;
    let one = Encoding::from_tokens(vec![Token::new(PROBE, "x".into(), (0, 1))], 0);
    let e = tokenizer
        .post_process(one, None, true)
        .map_err(|e| format!("its post-processor failed: {e}"))?;
    let text: Vec<usize> = (0..e.len())
        .filter(|&i| e.get_special_tokens_mask()[i] == 0)
        .collect();
    match text[..] {
        [i] if e.get_ids()[i] == PROBE => {
            Ok((e.get_ids()[..i].to_vec(), e.get_ids()[i + 1..].to_vec()))
        }
        _ => Err(format!(
            "its post-processor does not place the text's tokens once between special tokens \
             (a one-token text became {:?})",
            e.get_ids()
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BPE: &str = r#"{"type":"BPE","dropout":null,"unk_token":null,"continuing_subword_prefix":null,
        "end_of_word_suffix":null,"fuse_unk":false,"byte_fallback":false,"ignore_merges":false,
        "vocab":{"a":0,"b":1,"\u2581":2,">":3,"<":4,"s":5,"<s>":6},"merges":[]}"#;
    const UNIGRAM: &str = r#"{"type":"Unigram","unk_id":0,"vocab":[["<unk>",0.0],["a",-1.0],["\u2581",-1.0]],"byte_fallback":false}"#;
    const METASPACE: &str =
        r#"{"type":"Metaspace","replacement":"\u2581","prepend_scheme":"first","split":false}"#;

    fn tokenizer(normalizer: &str, pre: &str, model: &str, added: &str) -> Tokenizer {
        format!(
            r#"{{"version":"1.0","truncation":null,"padding":null,"added_tokens":[{added}],
            "normalizer":{normalizer},"pre_tokenizer":{pre},"post_processor":null,"decoder":null,
            "model":{model}}}"#
        )
        .parse()
        .unwrap()
    }

    fn plan(normalizer: &str, pre: &str, model: &str) -> CutPlan {
        CutPlan::new(&tokenizer(normalizer, pre, model, ""))
    }

    #[test]
    fn the_rule_follows_the_pipeline_and_unproven_ones_are_encoded_whole() {
        let byte_level =
            r#"{"type":"ByteLevel","add_prefix_space":true,"trim_offsets":true,"use_regex":true}"#;
        assert_eq!(
            plan("null", byte_level, BPE).rule(),
            Some(CutRule::AfterNewline)
        );
        let split = |p: &str| {
            format!(
                r#"{{"type":"Split","pattern":{{"Regex":{}}},"behavior":"Isolated","invert":false}}"#,
                serde_json::to_string(p).unwrap()
            )
        };
        assert_eq!(
            plan("null", &split(LLAMA3_PATTERN), BPE).rule(),
            Some(CutRule::AfterNewline)
        );
        let metaspace_split = METASPACE.replace("false", "true");
        assert_eq!(
            plan("null", &metaspace_split, UNIGRAM).rule(),
            Some(CutRule::BeforeSpace)
        );
        assert_eq!(
            plan("null", METASPACE, BPE).rule(),
            Some(CutRule::BeforeSpace)
        );
        for (normalizer, pre, model, words) in [
            ("null", METASPACE, UNIGRAM, "Unigram"),
            ("null", "null", UNIGRAM, "Unigram"),
            (
                r#"{"type":"Strip","strip_left":true,"strip_right":true}"#,
                METASPACE,
                BPE,
                "Strip",
            ),
            (
                r#"{"type":"Replace","pattern":{"Regex":" {2,}"},"content":" "}"#,
                METASPACE,
                BPE,
                "Replace",
            ),
            ("null", &split(r"\w+|\s+"), BPE, "Split"),
            (
                "null",
                r#"{"type":"Digits","individual_digits":true}"#,
                BPE,
                "Digits",
            ),
            (
                "null",
                METASPACE,
                &BPE.replace(r#""dropout":null"#, r#""dropout":0.1"#),
                "dropout",
            ),
        ] {
            let p = plan(normalizer, pre, model);
            assert_eq!(p.rule(), None, "{words}");
            let reason = p.whole_reason().unwrap();
            assert!(reason.contains(words), "{words}: {reason}");
        }
    }

    #[test]
    fn cuts_fall_where_the_rule_allows_and_no_added_token_touches() {
        let byte_level =
            r#"{"type":"ByteLevel","add_prefix_space":false,"trim_offsets":true,"use_regex":true}"#;
        let mut p = plan("null", byte_level, BPE);
        let text = "ab\nba\n b\n\nc\né\n\u{e9}";
        assert_eq!(
            p.find_cut(text.as_bytes(), 0),
            Some(Cut { at: 3, context: 2 })
        );
        // `\n b`, `\n\n`, `\nc` after a newline: no cut until after `c`.
        assert_eq!(
            p.find_cut(text.as_bytes(), 4),
            Some(Cut { at: 12, context: 2 })
        );
        // Before the last character, whose bytes are not all there: no cut.
        let short = &text.as_bytes()[..text.len() - 1];
        assert_eq!(p.find_cut(short, 13), None);
        assert_eq!(
            p.find_cut(text.as_bytes(), 13),
            Some(Cut { at: 15, context: 3 })
        );

        // A token that takes the whitespace after it (`rstrip`) would reach the cut after
        // `>\n`: the next newline is taken.
        let end = r#"{"id":6,"content":"<|end|>","single_word":false,"lstrip":false,"rstrip":true,"normalized":false,"special":true}"#;
        let mut p = CutPlan::new(&tokenizer("null", byte_level, BPE, end));
        let text = "a<|end|>\nb\nc";
        assert_eq!(
            p.find_cut(text.as_bytes(), 0),
            Some(Cut { at: 11, context: 2 })
        );

        let added = r#"{"id":6,"content":"<s>","single_word":false,"lstrip":false,"rstrip":false,"normalized":false,"special":true}"#;
        let mut p = CutPlan::new(&tokenizer("null", METASPACE, BPE, added));
        // Before the space after `<s>` (it ends with `>`): no; after `a`: yes.
        let text = "<s> a b";
        assert_eq!(
            p.find_cut(text.as_bytes(), 0),
            Some(Cut { at: 5, context: 1 })
        );
        // A character outside the vocabulary (byte fallback or unknown) is never beside a cut.
        assert_eq!(p.find_cut("x a".as_bytes(), 0), None);
    }
}
