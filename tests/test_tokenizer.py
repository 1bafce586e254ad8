"""The bytes tokenizer written as a ``tokenizer.json``: the same ids and text through the `tokenizers` library."""

from train.data.tokenizer import ByteTokenizer, HFTokenizer

TEXTS = ["def main():\n\treturn 'wörld' 🎉", "  two  spaces\r\n", "", "\x00\x7f control"]


def test_bytes_tokenizer_json_encodes_and_decodes_as_the_bytes_tokenizer(tmp_path):
    ours = ByteTokenizer()
    path = ours.save_json(tmp_path / "tokenizer.json")
    theirs = HFTokenizer(path)
    assert (theirs.vocab_size, theirs.eod_id) == (ours.vocab_size, ours.eod_id)
    docs = [t.encode() for t in TEXTS]
    for a, b, text in zip(ours.encode_batch(docs), theirs.encode_batch(docs), TEXTS):
        assert a.tolist() == b.tolist(), text
        assert theirs.decode(b.tolist()) == ours.decode(a.tolist()) == text
