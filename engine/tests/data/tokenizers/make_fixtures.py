"""Makes the tokenizer fixtures and golden token ids of `engine/tests/data_tokenizer_golden.rs`.

Each fixture is a small tokenizer (vocabulary 1000) of one family a published model ships,
trained with the Hugging Face `tokenizers` library on `testdata/tinyshakespeare.txt` and saved as
`<name>.json`:

| name                | shaped like        | normalizer           | pre-tokenizer                          | model          |
|---------------------|--------------------|----------------------|----------------------------------------|----------------|
| `gpt2_bytelevel`    | GPT-2              | none                 | ByteLevel (GPT-2 regex)                | BPE            |
| `llama3_split`      | Llama 3            | none                 | Split (Llama 3 regex) + ByteLevel      | BPE, ignore_merges |
| `qwen2_nfc`         | Qwen2              | NFC                  | Split (Qwen2 regex) + ByteLevel        | BPE            |
| `llama2_prepend`    | Llama 2            | Prepend ▁ + Replace  | none                                   | BPE, byte fallback |
| `mistral_metaspace` | Mistral            | none                 | Metaspace first, split false           | BPE, byte fallback |
| `t5_unigram`        | T5                 | NFKC                 | WhitespaceSplit + Metaspace always     | Unigram        |
| `bert_wordpiece`    | BERT (uncased)     | BertNormalizer       | BertPreTokenizer                       | WordPiece      |
| `unigram_unsplit`   | (no published one) | none                 | Metaspace first, split false           | Unigram        |

The last one encodes a whole text as one Unigram lattice, which `fsdp data tokenize` cannot
prove safe to cut: it encodes it whole.

The texts: `text.txt` (an excerpt of `testdata/tinyshakespeare.txt` followed by lines of
non-ASCII letters, combining marks, CJK, emoji, tabs, runs of spaces, CRLF line ends and the
fixtures' special tokens written out) and `doc2.txt` (a short second document).

The golden ids: for each fixture and text, `Tokenizer.encode(text, add_special_tokens=False)`
written as a token file (`<name>.<text>.bin`, the format of `fsdp data tokenize`: the 64-byte
header with the vocabulary size and the SHA-256 of `<name>.json`, then u16 little-endian ids),
and in `golden.json` what `add_special_tokens=True` adds before and after those ids (checked
here to be exactly `encode(text, add_special_tokens=True)`).

Run by hand from the repository root, with `tokenizers` 0.23 installed (`pip install
tokenizers==0.23.3`):

    python engine/tests/data/tokenizers/make_fixtures.py

It rewrites every file of this directory but itself; the outputs are deterministic.
"""

import hashlib
import json
import os
import struct
import sys

import tokenizers
from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", "..", "..", ".."))
CORPUS = os.path.join(ROOT, "testdata", "tinyshakespeare.txt")
VOCAB = 1000

LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Lines after the Shakespeare excerpt: what a corpus holds besides plain English.
EXTRA = (
    "\n"
    "Caf\u00e9 na\u00efve r\u00e9sum\u00e9, and the same with combining marks: cafe\u0301 nai\u0308ve.\n"
    "\u6771\u4eac\u90fd\u306e\u5929\u6c17\u306f\u6674\u308c\u3002\u4eca\u65e5\u306f\u826f\u3044\u65e5\u3067\u3059\u3002\n"
    "\u039a\u03b1\u03bb\u03b7\u03bc\u03ad\u03c1\u03b1 \u03ba\u03cc\u03c3\u03bc\u03b5 \U0001f642 \U0001f44b\U0001f3fd ok\n"
    "\u0301a line that starts with a combining mark\n"
    "\ttabbed\tcolumns\t1\t22\t333\n"
    "spaces   inside    and after   \n"
    "   leading spaces\n"
    "windows line\r\n"
    "ends\r\n"
    "\n\n\n"
    "numbers 12345 6789012 3.14159 and don't won't it's we'll\n"
    "ligature \ufb01ne, nbsp\u00a0here, ideographic\u3000space, \u00bd half\n"
    "special tokens written out: <s> hello </s> <|endoftext|> [SEP] [CLS] <unk> <|begin_of_text|>\n"
    "<s>glued</s>and<|endoftext|>glued\n"
    "averyveryveryveryveryveryveryveryveryveryveryveryveryveryveryverylongwordwithoutanyspaceatall\n"
    "last line without a newline"
)

DOC2 = (
    "A second document.\n\n"
    "  It starts after the first one ends, and has its own first word.\n"
    "Na\u00efve \u00e9t\u00e9 \u6771\u4eac \U0001f642\n"
)

BYTE_TOKENS = ["<0x%02X>" % b for b in range(256)]


def corpus_text():
    with open(CORPUS, encoding="utf-8") as f:
        return f.read()


def excerpt():
    """About 24 KB of whole lines from the middle of the corpus, then EXTRA."""
    text = corpus_text()
    start = text.index("\n", 400_000) + 1
    end = text.index("\n", start + 24_000) + 1
    return text[start:end] + EXTRA


def bpe_trainer(special, vocab_size=VOCAB, **kw):
    return trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=special, show_progress=False, **kw
    )


def train(tok, trainer):
    tok.train([CORPUS], trainer)
    return tok


def byte_level(pre, normalizer=None, special=(), ignore_merges=False):
    tok = Tokenizer(models.BPE(ignore_merges=ignore_merges))
    tok.normalizer = normalizer
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    train(
        tok,
        bpe_trainer(
            [AddedToken(s, special=True, normalized=False) for s in special],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    return tok


def sentencepiece_bpe(normalizer, pre):
    """BPE with byte fallback laid out as Llama 2's: <unk>, <s>, </s>, the 256 byte tokens,
    then the pieces; trained on words split at spaces (as SentencePiece does), so no piece
    holds a ▁ after its first character."""
    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    train(
        trained,
        bpe_trainer(["<unk>", "<s>", "</s>"], limit_alphabet=120, vocab_size=VOCAB - 256),
    )
    spec = json.loads(trained.to_str())["model"]
    pieces = sorted(spec["vocab"].items(), key=lambda kv: kv[1])
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for t in BYTE_TOKENS:
        vocab[t] = len(vocab)
    for piece, _ in pieces:
        if piece not in vocab:
            vocab[piece] = len(vocab)
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in spec["merges"]]
    tok = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True)
    )
    tok.normalizer = normalizer
    tok.pre_tokenizer = pre
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in ["<unk>", "<s>", "</s>"]])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    tok.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return tok


def unigram(normalizer, pre, post):
    tok = Tokenizer(models.Unigram())
    tok.normalizer = normalizer
    tok.pre_tokenizer = pre
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    train(
        tok,
        trainers.UnigramTrainer(
            vocab_size=VOCAB,
            special_tokens=["<pad>", "</s>", "<unk>"],
            unk_token="<unk>",
            show_progress=False,
        ),
    )
    tok.post_processor = post
    return tok


def fixtures():
    eos = processors.TemplateProcessing(
        single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", 1)]
    )
    out = {}
    out["gpt2_bytelevel"] = byte_level(
        pre_tokenizers.ByteLevel(add_prefix_space=False), special=["<|endoftext|>"]
    )
    out["gpt2_bytelevel"].post_processor = processors.ByteLevel(trim_offsets=True)

    llama3 = byte_level(
        pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        ),
        special=["<|begin_of_text|>", "<|end_of_text|>"],
        ignore_merges=True,
    )
    bos = llama3.token_to_id("<|begin_of_text|>")
    llama3.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single="<|begin_of_text|> $A",
                pair="<|begin_of_text|> $A <|begin_of_text|> $B",
                special_tokens=[("<|begin_of_text|>", bos)],
            ),
        ]
    )
    out["llama3_split"] = llama3

    out["qwen2_nfc"] = byte_level(
        pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        ),
        normalizer=normalizers.NFC(),
        special=["<|endoftext|>"],
    )
    out["qwen2_nfc"].post_processor = processors.ByteLevel(trim_offsets=False)

    out["llama2_prepend"] = sentencepiece_bpe(
        normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")]),
        None,
    )
    out["mistral_metaspace"] = sentencepiece_bpe(
        None, pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    )
    out["t5_unigram"] = unigram(
        normalizers.NFKC(),
        pre_tokenizers.Sequence(
            [
                pre_tokenizers.WhitespaceSplit(),
                pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always", split=True),
            ]
        ),
        eos,
    )
    out["unigram_unsplit"] = unigram(
        None,
        pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False),
        eos,
    )

    bert = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    bert.normalizer = normalizers.BertNormalizer(lowercase=True)
    bert.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    bert.decoder = decoders.WordPiece()
    train(
        bert,
        trainers.WordPieceTrainer(
            vocab_size=VOCAB,
            special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"],
            show_progress=False,
        ),
    )
    bert.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", bert.token_to_id("[CLS]")), ("[SEP]", bert.token_to_id("[SEP]"))],
    )
    out["bert_wordpiece"] = bert
    return out


def token_file(path, ids, vocab, sha):
    assert vocab <= 65536 and all(0 <= i < vocab for i in ids)
    header = b"FSDPTOK\0" + struct.pack("<IIQQ", 1, 2, len(ids), vocab) + sha
    assert len(header) == 64
    with open(path, "wb") as f:
        f.write(header + struct.pack("<%dH" % len(ids), *ids))


def main():
    if not tokenizers.__version__.startswith("0.23."):
        sys.exit(f"tokenizers {tokenizers.__version__}: install 0.23 (pip install tokenizers==0.23.3)")
    texts = {"text": excerpt(), "doc2": DOC2}
    for name, text in texts.items():
        with open(os.path.join(HERE, name + ".txt"), "w", encoding="utf-8", newline="") as f:
            f.write(text)
    golden = {"tokenizers_version": tokenizers.__version__, "fixtures": {}}
    for name, tok in fixtures().items():
        path = os.path.join(HERE, name + ".json")
        tok.save(path, pretty=False)
        with open(path, "rb") as f:
            raw = f.read()
        sha = hashlib.sha256(raw).digest()
        tok = Tokenizer.from_str(raw.decode("utf-8"))
        vocab = tok.get_vocab_size(with_added_tokens=True)
        entry = {"vocab_size": vocab}
        for tname, text in texts.items():
            ids = tok.encode(text, add_special_tokens=False).ids
            with_special = tok.encode(text, add_special_tokens=True).ids
            n = len(ids)
            before = next(i for i in range(len(with_special) + 1) if with_special[i : i + n] == ids)
            prefix, suffix = with_special[:before], with_special[before + n :]
            assert prefix + ids + suffix == with_special
            token_file(os.path.join(HERE, f"{name}.{tname}.bin"), ids, vocab, sha)
            entry[tname] = {"tokens": n, "special_prefix": prefix, "special_suffix": suffix}
        golden["fixtures"][name] = entry
        print(name, vocab, entry["text"]["tokens"], len(raw), "bytes")
    with open(os.path.join(HERE, "golden.json"), "w") as f:
        json.dump(golden, f, indent=1, sort_keys=True)
        f.write("\n")


if __name__ == "__main__":
    main()
