"""Data: sharding is disjoint and layout-free, positions resume, the eval split is stable, bad data is one line."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from engine.config import DataConfig
from engine.data import (ByteTokenizer, FakeSource, PackedSource, TokenStream, build_data, is_eval_document,
                         shard_of)
from engine.world import World


def world(rank=0, size=1, grank=None, gsize=None) -> World:
    return World(rank=rank, world_size=size, local_rank=rank, hostname="h", pid=1, global_rank=grank,
                 global_world_size=gsize)


def rows(stream: TokenStream, n: int) -> list[tuple[int, ...]]:
    x, y = stream.next_batch(n)
    assert torch.equal(x[:, 1:], y[:, :-1])  # labels are the inputs shifted by one
    return [tuple(r) for r in torch.cat([x, y[:, -1:]], dim=1).tolist()]


def source(seq_len=8, n_tokens=8 * 40 + 1) -> PackedSource:
    return PackedSource(np.arange(n_tokens, dtype=np.int32) % 50_000, seq_len)


def test_shard_index_from_world():
    assert shard_of(world(1, 2)) == (1, 2)
    assert shard_of(world(1, 2, grank=2, gsize=3)) == (5, 6)
    with pytest.raises(ValueError, match="GLOBAL_RANK=3 is outside GLOBAL_WORLD_SIZE=3"):
        shard_of(world(0, 1, grank=3, gsize=3))


def test_shards_are_disjoint_and_cover_the_epoch():
    src = source()
    seen = [rows(TokenStream(src, s, 4, seed=0), 10) for s in range(4)]  # 4 x 10 = the 40 sequences
    flat = [r for part in seen for r in part]
    assert len(set(flat)) == 40 == src.num_sequences


def test_union_of_a_global_batch_is_layout_free():
    """One worker reading 8 sequences sees exactly what two workers reading 4 each see together."""
    src = source()
    one = rows(TokenStream(src, 0, 1, seed=3), 8)
    two = rows(TokenStream(src, 0, 2, seed=3), 4) + rows(TokenStream(src, 1, 2, seed=3), 4)
    assert sorted(one) == sorted(two)


def test_resume_position_continues_the_stream():
    src = source()
    a = TokenStream(src, 1, 2, seed=5)
    rows(a, 7)
    state = a.state_dict()
    assert state["position"] == 14
    expected = rows(a, 30)  # crosses into the next epoch (a new permutation)
    b = TokenStream(src, 1, 2, seed=5)
    b.load_state_dict(state)
    assert rows(b, 30) == expected
    with pytest.raises(ValueError, match="data differs"):
        TokenStream(source(n_tokens=200), 1, 2, seed=5).load_state_dict(state)
    # another seed is another order: the position would repeat some sequences and skip others, silently
    with pytest.raises(ValueError, match=r"train\.seed = 7 here, 5 in the checkpoint"):
        TokenStream(src, 1, 2, seed=7).load_state_dict(state)
    TokenStream(src, 1, 2, seed=7).load_state_dict({k: v for k, v in state.items() if k != "seed"})  # older ones


def test_fake_data_is_deterministic_and_learnable_shape():
    s = FakeSource(258, 16, seed=1)
    assert np.array_equal(s.sequence(7), FakeSource(258, 16, seed=1).sequence(7))
    assert not np.array_equal(s.sequence(7), s.sequence(8))
    assert s.sequence(3).max() < 258 and len(s.sequence(3)) == 17


def test_eval_split_is_stable_and_near_the_asked_share():
    docs = [f"document number {i}" for i in range(4000)]
    held = [d for d in docs if is_eval_document(d, 10.0)]
    assert 300 < len(held) < 500
    assert held == [d for d in reversed(docs) if is_eval_document(d, 10.0)][::-1]
    assert not any(is_eval_document(d, 0.0) for d in docs)


def test_corpus_folder_glob_and_jsonl(tmp_path, repo_root):
    (tmp_path / "a.txt").write_text("hello world " * 40)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.jsonl").write_text(json.dumps({"body": "jsonl text " * 40}) + "\n\n")
    (tmp_path / "ignored.bin").write_bytes(b"\0" * 1000)
    cfg = DataConfig(path=str(tmp_path), seq_len=16, eval_percent=0, text_field="body")
    data = build_data(cfg, world(), seed=0)
    assert data.vocab_size == 258 and data.eval is None
    # bos + bytes + eos per document: 2 * (480 + 440 + 2) tokens
    assert data.train.source.num_sequences == (480 + 2 + 440 + 2 - 1) // 16
    glob_cfg = DataConfig(path=str(tmp_path / "*.txt"), seq_len=16, eval_percent=0)
    assert build_data(glob_cfg, world(), 0).train.source.num_sequences == (482 - 1) // 16
    shipped = build_data(DataConfig(path=str(repo_root / "corpus"), seq_len=128), world(), 0)
    assert shipped.train.source.num_sequences > 5000 and shipped.eval is not None
    text = ByteTokenizer().decode(shipped.train.next_batch(1)[0][0].tolist())
    assert sum(c.isalpha() for c in text) > len(text) / 2  # English prose, not noise


@pytest.mark.parametrize("setup, message", [
    (lambda p: None, "does not exist"),
    (lambda p: p.mkdir(), "no .txt, .md, .jsonl, .parquet or .arrow files"),
    (lambda p: (p.mkdir(), (p / "x.jsonl").write_text('{"text": "ok"}\nnot json\n')), r"x\.jsonl:2: not a JSON"),
    (lambda p: (p.mkdir(), (p / "x.jsonl").write_text('{"content": "ok"}\n')), r"x\.jsonl:1: no string field"),
    (lambda p: (p.mkdir(), (p / "x.txt").write_text("tiny")), "fewer than data.seq_len"),
])
def test_bad_data_is_one_clear_error(tmp_path, setup, message):
    target = tmp_path / "corpus"
    setup(target)
    with pytest.raises(ValueError, match=message):
        build_data(DataConfig(path=str(target), seq_len=16, eval_percent=0), world(), 0)


def test_local_transformers_tokenizer_folder(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    text = "the quick brown fox jumps over the lazy dog " * 50
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([text], trainers.WordLevelTrainer(special_tokens=["<unk>", "<s>", "</s>"]))
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(tmp_path / "tok")
    (tmp_path / "corpus.txt").write_text(text)
    cfg = DataConfig(path=str(tmp_path / "corpus.txt"), tokenizer=str(tmp_path / "tok"), seq_len=8,
                     eval_percent=0)
    data = build_data(cfg, world(), seed=0)
    assert data.vocab_size == 11  # 8 words + 3 specials
    ids = data.train.source.tokens
    assert ids[0] == data.tokenizer.bos_id and ids[-1] == data.tokenizer.eos_id and len(ids) == 9 * 50 + 2
    assert data.tokenizer.decode(ids[1:5].tolist()) == "the quick brown fox"
    with pytest.raises(ValueError, match="data.tokenizer: .* is not a folder"):
        build_data(cfg.model_copy(update={"tokenizer": str(tmp_path / "missing")}), world(), 0)
