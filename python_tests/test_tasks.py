"""The task suite: generators, held-out splits, exact-match scoring, packing, tokenizer."""
import random

import pytest

pytest.importorskip("safetensors")
pytest.importorskip("transformers")
import torch

from dllm_ops.tasks import (BLOCK_LENGTH, GEN_LENGTH, TASKS, calibration_pairs, encode, exact_match,
                            pack, problems, sample, split_of, task_names, task_tokenizer, vocab_ids)

V = vocab_ids()
EOS, MASK, PAD, BOS = V["<eos>"], V["<mask>"], V["<pad>"], V["<bos>"]


def _digits(words):
    return [int(w) for w in words]


def _items(field):
    """Digits of a fixed-width field: the items, then only fillers."""
    n = field.index("_") if "_" in field else len(field)
    assert all(w == "_" for w in field[n:]) and all(w.isdigit() for w in field[:n])
    return field[:n]


def _solve(prompt: str) -> list[str]:
    """An independent solver working from the prompt text alone."""
    words = prompt.split()
    assert words[0] == "<bos>" and words[-1] == "="
    op, body = words[1], words[2:-1]
    if op == "+":  # lag2's task word
        op = "lag2"
    if op == "add":
        plus = body.index("+")
        assert plus == 10 and len(body) == 21
        a = int("".join(reversed(_items(body[:plus]))))
        b = int("".join(reversed(_items(body[plus + 1:]))))
        return list(str(a + b))[::-1]
    if op == "scan":
        assert len(body) == 15
        out, s = [], 0
        for d in _digits(_items(body)):
            s += d
            out.append(str(s % 10))
        return out
    if op == "lag2":
        # Two interleaved running sums: token j sums the digits at j, j-2, j-4, ...
        assert len(body) == 15
        xs = _digits(_items(body))
        return [str(sum(xs[i] for i in range(j % 2, j + 1, 2)) % 10) for j in range(len(xs))]
    if op == "sub":
        src, dst, colon = body[0], body[1], body[2]
        assert colon == ":" and len(body) == 43 and src[0] == "s" and dst[0] == "d"
        src, dst = src[1:], dst[1:]
        return [dst if w == src else w for w in _items(body[3:])]
    raise AssertionError(op)


@pytest.mark.parametrize("task", list(TASKS))
def test_answers_are_correct(task):
    for p in problems(task, 300, seed=1):
        assert p.task == task
        assert p.answer.split() == _solve(p.prompt)
        assert p.prompt_ids == encode(p.prompt.split()) and p.prompt_ids[0] == BOS
        assert p.answer_ids == encode(p.answer.split())
        assert EOS not in p.answer_ids and MASK not in p.prompt_ids + p.answer_ids


def test_answer_lengths_span_4_to_40_and_fit_the_generation_length():
    lengths = {t: [len(p.answer_ids) for p in problems(t, 1000, seed=2)] for t in TASKS}
    for t, ls in lengths.items():
        g = TASKS[t].gen_length
        assert g % BLOCK_LENGTH == 0 and g <= GEN_LENGTH
        assert min(ls) >= 4 and max(ls) < g, t       # room for at least one EOS
        assert max(ls) - min(ls) >= 7, t             # every task has several answer lengths
    everything = sum(lengths.values(), [])
    assert min(everything) == 4 and max(everything) == 40
    assert max(TASKS[t].gen_length for t in TASKS) == GEN_LENGTH == 3 * BLOCK_LENGTH


def test_add_has_carries_and_operands_without_leading_zeros():
    carries = 0
    for p in problems("add", 300, seed=3):
        words = p.prompt.split()[2:-1]
        plus = words.index("+")
        a, b = _items(words[:plus]), _items(words[plus + 1:])
        assert a[-1] != "0" and b[-1] != "0"  # most significant digits
        carries += len(p.answer_ids) > max(len(a), len(b))
    assert carries > 20  # the final carry happens often enough


def test_lag2_needs_the_answer_two_tokens_back():
    """Token j is the prompt digit j plus answer token j-2 (mod 10), and not a
    function of token j-1 alone: for each j >= 2 some pair of problems agrees on
    the prompt digit and answer token j-1 but not on answer token j."""
    ps = problems("lag2", 500, seed=6)
    seen = {}
    conflicts = set()
    for p in ps:
        xs = _digits(_items(p.prompt.split()[2:-1]))
        ys = _digits(p.answer.split())
        assert 8 <= len(ys) == len(xs) <= 15
        assert ys[:2] == xs[:2]
        for j in range(2, len(ys)):
            assert ys[j] == (xs[j] + ys[j - 2]) % 10
            key = (j, xs[j], ys[j - 1])
            if seen.setdefault(key, ys[j]) != ys[j]:
                conflicts.add(j)
    assert conflicts == set(range(2, 15))


def test_sub_rule_always_fires():
    for p in problems("sub", 300, seed=4):
        src = p.prompt.split()[2][1:]   # "s3" -> "3"
        assert src in _items(p.prompt.split()[5:-1])


@pytest.mark.parametrize("task", list(TASKS))
def test_problems_are_deterministic_distinct_and_seeded(task):
    a, b, c = problems(task, 200, 7), problems(task, 200, 7), problems(task, 200, 8)
    assert a == b
    assert len({p.prompt for p in a}) == 200
    assert [p.prompt for p in a] != [p.prompt for p in c]
    assert problems(task, 50, 7) == a[:50]


@pytest.mark.parametrize("task", list(TASKS))
def test_splits_are_disjoint(task):
    test = problems(task, 300, 0, "test")
    calib = problems(task, 100, 0, "calib")
    assert all(split_of(p.prompt) == "test" for p in test)
    assert all(split_of(p.prompt) == "calib" for p in calib)
    rng = random.Random(5)
    train = [sample(task, rng, "train") for _ in range(2000)]
    assert all(split_of(p.prompt) == "train" for p in train)
    assert not {p.prompt for p in train} & {p.prompt for p in test + calib}


def test_split_sizes_are_roughly_as_designed():
    rng = random.Random(0)
    counts = {"train": 0, "test": 0, "calib": 0}
    for _ in range(4000):
        words, _ = TASKS["scan"].make(rng)
        counts[split_of(" ".join(["<bos>", *words]))] += 1
    assert 0.09 < counts["test"] / 4000 < 0.16
    assert 0.04 < counts["calib"] / 4000 < 0.09


def test_calibration_pairs_cycle_tasks_and_are_deterministic():
    pairs = calibration_pairs(10, seed=0)
    assert [p.task for p in pairs[:len(TASKS)]] == list(TASKS) == ["add", "scan", "sub", "lag2"]
    assert pairs == calibration_pairs(10, seed=0)
    assert all(split_of(p.prompt) == "calib" for p in pairs)
    only = calibration_pairs(5, tasks="add,sub")
    assert [p.task for p in only] == ["add", "sub", "add", "sub", "add"]


def test_exact_match_rules():
    p = problems("scan", 1, 0)[0]
    ans = list(p.answer_ids)
    assert exact_match(p, ans)                                   # no EOS, nothing more
    assert exact_match(p, ans + [EOS] * 5)                       # EOS padding
    assert exact_match(p, ans + [EOS, 7, 8])                     # text after the first EOS dropped
    assert not exact_match(p, ans + [7, EOS])                    # one token too many
    assert not exact_match(p, ans[:-1] + [EOS])                  # one token short
    assert not exact_match(p, [MASK] + ans[1:] + [EOS])          # undecoded
    wrong = ans.copy()
    wrong[len(wrong) // 2] = V["9"] if wrong[len(wrong) // 2] != V["9"] else V["0"]
    assert not exact_match(p, wrong + [EOS])
    assert exact_match(p, torch.tensor(ans + [EOS]).tolist())


def test_pack_lays_out_left_padded_canvases():
    batch = problems("add", 3, 0) + problems("sub", 2, 0)
    x, valid, region = pack(batch)
    L = max(len(p.prompt_ids) for p in batch)
    assert x.shape == (5, L + GEN_LENGTH)   # the longest generation length in the batch
    assert region[:, L:].all() and not region[:, :L].any()
    for r, p in enumerate(batch):
        pad = L - len(p.prompt_ids)
        assert (x[r, :pad] == PAD).all() and not valid[r, :pad].any() and valid[r, pad:].all()
        assert tuple(x[r, pad:L].tolist()) == p.prompt_ids
        assert tuple(x[r, L:L + len(p.answer_ids)].tolist()) == p.answer_ids
        assert (x[r, L + len(p.answer_ids):] == EOS).all()
        assert exact_match(p, x[r, L:].tolist())
    xm, _, _ = pack(batch, with_answers=False)
    assert (xm[:, L:] == MASK).all() and torch.equal(xm[:, :L], x[:, :L])
    x16, _, r16 = pack(problems("add", 2, 0))
    assert x16.shape[1] == len(problems("add", 1, 0)[0].prompt_ids) + TASKS["add"].gen_length == 40
    assert int(r16[0].sum()) == 16
    with pytest.raises(ValueError, match="exceeds gen_length"):
        pack(batch, gen_length=8)


def test_task_names():
    assert task_names("all") == list(TASKS)
    assert task_names("add,sub") == ["add", "sub"]
    assert task_names(["scan"]) == ["scan"]
    assert task_names(["all"]) == list(TASKS)   # `bench decode --task all` passes a list
    with pytest.raises(ValueError, match="unknown task"):
        task_names("add,mul")
    with pytest.raises(ValueError, match="unknown split"):
        sample("add", random.Random(0), "dev")


def test_tokenizer_round_trips_through_autotokenizer(tmp_path):
    from transformers import AutoTokenizer

    task_tokenizer().save_pretrained(tmp_path)
    assert (tmp_path / "tokenizer.json").exists() and (tmp_path / "tokenizer_config.json").exists()
    tok = AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.mask_token_id) == (PAD, BOS, EOS, MASK)
    assert len(tok) == len(V) and tok.get_vocab() == V
    for t in TASKS:
        p = problems(t, 1, 0)[0]
        assert tuple(tok(p.prompt, add_special_tokens=False)["input_ids"]) == p.prompt_ids
        assert tok.decode(list(p.answer_ids)) == p.answer
    body = p.prompt.split(" ", 1)[1]
    chat = tok.apply_chat_template([{"role": "user", "content": body}], tokenize=False,
                                   add_generation_prompt=True)
    assert tuple(tok(chat, add_special_tokens=False)["input_ids"]) == p.prompt_ids
