"""The drift benchmark's analysis as pure functions over hand-made samples, against plain reference sums."""

from __future__ import annotations

import pytest

from benchmarks import drift
from benchmarks.drift import Sample
from dvi.errors import DviError


def s(slot, side="online", phase=0, domain="code", rounds=10, accepted=20, k=4, seconds=1.0, version="d0001", tokens=None):
    drafted = rounds * k
    return Sample(slot=slot, phase=phase, domain=domain, side=side, t=float(slot), version=version, rounds=rounds,
                  drafted=drafted, accepted=accepted, tokens=tokens if tokens is not None else accepted + rounds, seconds=seconds)


def test_acceptance_length_and_speed_are_the_plain_sums():
    rows = [s(0, accepted=10), s(1, accepted=30, rounds=20, seconds=2.0)]
    assert drift.acceptance(rows) == pytest.approx(40 / 120)
    assert drift.mean_accepted_length(rows) == pytest.approx((20 + 50) / 30)  # bonus tokens included: >= 1
    assert drift.median_tokens_per_s(rows) == pytest.approx((20 + 25) / 2)
    assert drift.acceptance([]) is None and drift.median_tokens_per_s([]) is None


def test_paired_ratio_pairs_by_slot_and_takes_the_median():
    online = [s(0, seconds=1.0), s(1, seconds=1.0), s(2, seconds=1.0), s(3)]
    frozen = [s(0, "frozen", seconds=2.0), s(1, "frozen", seconds=4.0), s(2, "frozen", seconds=1.0)]  # no slot 3
    assert drift.paired_ratio(online, frozen) == pytest.approx(2.0)


def test_trailing_window_and_recovery_rounds():
    # 10 requests of 10 rounds each: acceptance 0.1 for five, then 0.6
    rows = [s(i, accepted=4 if i < 5 else 24) for i in range(10)]
    assert [r.slot for r in drift.trailing(rows, 25)] == [7, 8, 9]  # at least 25 rounds: three requests
    assert drift.trailing(rows, 1000) == rows
    rolling = drift.rolling_acceptance(rows, 20)
    assert rolling[0] == (10, pytest.approx(0.1)) and rolling[-1] == (100, pytest.approx(0.6))
    # level 0.6 within 0.05: the first full 20-round window at >= 0.55 ends after request 6 (slots 5, 6)
    assert drift.recovery_rounds(rows, level=0.6, tolerance=0.05, window=20) == 70
    assert drift.recovery_rounds(rows, level=0.9, tolerance=0.05, window=20) is None
    # a window is never judged before it is full, even when the very first request is good
    assert drift.recovery_rounds([s(0, accepted=40)], level=0.5, tolerance=0.05, window=20) is None


def test_summary_finds_recovery_gain_speedup_forgetting_and_swaps():
    rows = []
    slot = 0
    plan = [("code", [36] * 6), ("prose", [8, 8, 20, 30, 34, 36]), ("code", [35] * 6)]  # accepted of 40 drafted
    for phase, (domain, accs) in enumerate(plan):
        for acc in accs:
            version = "d0001" if slot < 8 else "d0002"  # the online replica swaps at slot 8
            rows.append(s(slot, phase=phase, domain=domain, accepted=acc, version=version, tokens=30, seconds=1.0))
            rows.append(s(slot, "frozen", phase=phase, domain=domain, accepted=36 if domain == "code" else 8, tokens=30,
                          seconds=1.5))
            rows.append(s(slot, "plain", phase=phase, domain=domain, accepted=0, k=0, version=None, tokens=30, seconds=2.0))
            slot += 1
    summary = drift.summarize(rows, ["code", "prose", "code"], window=20)
    assert summary["level"] == pytest.approx(0.9)
    prose = summary["phases"][1]
    # the phase ends at 70 / 80: slots 10-11 (accepted 34, 36) make the first window at >= 0.875 - 0.05
    assert prose["final_online_acceptance"] == pytest.approx(70 / 80) and prose["recovery_rounds"] == 60
    assert prose["late_online_acceptance"] == pytest.approx(70 / 80) and prose["late_frozen_acceptance"] == pytest.approx(0.2)
    assert prose["online_vs_frozen"] == pytest.approx(1.5)
    assert summary["swaps"] == [{"slot": 8, "t": 8.0, "phase": 1, "version": "d0002", "previous": "d0001"}]
    # prose: recovery, gain, speed over frozen, over target-only; code again: recovery, no forgetting
    assert [c["ok"] for c in summary["targets"]] == [True] * 6
    assert [c["measured"] for c in summary["targets"]] == [60, pytest.approx(70 / 80 - 0.2), pytest.approx(1.5), pytest.approx(2.0),
                                                             20, pytest.approx(35 / 40)]
    text = drift.table(summary)
    assert "| 1 | prose | 6 | 60 |" in text and "NOT met" not in text


def test_summary_says_when_a_target_is_missed():
    rows = [s(i, phase=0, accepted=36) for i in range(3)]
    # prose reaches its final level only after 1,500 rounds, no better than the frozen drafter, no target-only side
    for i, acc in enumerate([100, 100, 100, 100, 600, 600]):
        rows += [s(3 + i, side, phase=1, domain="prose", rounds=300, accepted=acc) for side in ("online", "frozen")]
    summary = drift.summarize(rows, ["code", "prose"], window=20)
    assert [c["ok"] for c in summary["targets"]] == [False, False, False, False]
    assert summary["phases"][1]["recovery_rounds"] == 1500 and summary["targets"][3]["measured"] is None
    assert drift.table(summary).count("NOT met") == 4


def test_schedule_parsing():
    assert drift.parse_schedule("code, prose,qa") == ["code", "prose", "qa"]
    with pytest.raises(DviError, match="two or more"):
        drift.parse_schedule("code,poetry")
    with pytest.raises(DviError, match="two or more"):
        drift.parse_schedule("code")
    assert drift.Options(rounds=50, first_rounds=10, schedule=["code", "prose", "qa"]).budgets() == [10, 50, 50]


def test_the_plot_is_drawn_from_the_samples(tmp_path):
    rows = [s(i, phase=i // 4, domain="code" if i < 4 else "prose", accepted=36 if i < 4 else 8 + 4 * i) for i in range(8)]
    rows += [s(i, "frozen", phase=i // 4, domain="code" if i < 4 else "prose", seconds=1.5) for i in range(8)]
    rows += [s(i, "plain", phase=i // 4, domain="code" if i < 4 else "prose", version=None, seconds=2.0) for i in range(0, 8, 2)]
    summary = drift.summarize(rows, ["code", "prose"], window=20)
    drift.plot(rows, summary, str(tmp_path / "drift.png"))
    assert (tmp_path / "drift.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_bootstrap_version_is_the_last_one_the_distillation_published(tmp_path):
    log_file = tmp_path / "bootstrap.log"
    out = ('some progress\n{"step": 12, "published": 2, "serving": "d0002", "serving_dir": "/s/d0002", '
           '"published_versions": ["d0001", "d0002"]}\n')
    assert drift.distill_result(out, log_file)["published_versions"] == ["d0001", "d0002"]
    for bad in ("", "step 12: ...\n/s/d0002\n", '{"step": 12, "published": 2}\n'):
        with pytest.raises(DviError, match="bootstrap.log"):
            drift.distill_result(bad, log_file)


def test_command_line_options_and_errors(capsys):
    args = drift.build_parser().parse_args(["--quick", "--rounds", "50", "--schedule", "qa,code", "--out", "o"])
    opt = drift.options_of(args)
    assert (opt.rounds, opt.first_rounds, opt.schedule, opt.out) == (50, 120, ["qa", "code"], drift.Path("o"))
    assert drift.main(["--rounds", "0"]) == 2
    assert "drift: error: --rounds=0: expected a positive integer" in capsys.readouterr().err
    assert drift.main(["--quick", "--bogus"]) == 2
    assert "drift: error: unrecognized arguments: --bogus" in capsys.readouterr().err


def test_the_stack_picks_the_experiment_config_and_plain_vllms_answers_are_target_only_samples():
    assert drift.options_of(drift.build_parser().parse_args([])).stack == "dvi"
    assert drift.options_of(drift.build_parser().parse_args(["--stack", "vllm"])).stack == "vllm"
    cfg = drift.load_config([f"+experiment={drift.STACKS['vllm']}"])
    assert cfg.serve.engine == "vllm-server" and cfg.serve.spec.adaptive and cfg.model.drafter_vocab is None
    assert cfg.trainer.gate_every == drift.load_config([f"+experiment={drift.STACKS['dvi']}"]).trainer.gate_every
    plain = {"choices": [{"text": "x"}], "usage": {"completion_tokens": 12}}  # plain vLLM: no dvi extension
    sample = drift.sample_of(plain, 0.5, slot=3, phase=1, domain="prose", side="plain", t=1.0)
    assert (sample.rounds, sample.drafted, sample.accepted, sample.version, sample.tokens_per_s) == (12, 0, 0, None, 24.0)
    # a replica's answer carries dvi's extension (dvi's API, or dvi's plugin on vLLM's own server): its rounds and drafts
    ext = {"drafter_versions": ["d0001", "d0002"], "stats": {"rounds": 5, "drafted": 12, "accepted": 7}}
    sample = drift.sample_of({**plain, "dvi": ext}, 0.5, slot=3, phase=1, domain="prose", side="online", t=1.0)
    assert (sample.rounds, sample.drafted, sample.accepted, sample.version) == (5, 12, 7, "d0002")
    with pytest.raises(DviError, match="the frozen replica's answer has no `dvi` field"):  # never counted as drafting nothing
        drift.sample_of(plain, 0.5, slot=3, phase=1, domain="prose", side="frozen", t=1.0)


def test_the_serial_replay_turns_the_order_of_the_sides_and_the_trainer_cores_need_a_vllm_stack(capsys):
    assert [drift.turn(["online", "frozen", "plain"], i) for i in range(4)] == [
        ["online", "frozen", "plain"], ["frozen", "plain", "online"], ["plain", "online", "frozen"], ["online", "frozen", "plain"]]
    assert drift.turn(["online", "frozen"], 3) == ["frozen", "online"] and drift.turn([], 5) == []
    opt = drift.options_of(drift.build_parser().parse_args(["--serial", "--stack", "vllm"]))
    assert opt.serial and opt.trainer_cores is None
    assert not drift.options_of(drift.build_parser().parse_args([])).serial
    assert drift.main(["--trainer-cores", "0"]) == 2  # dvi's engine: nothing to pin its servers with
    assert "--trainer-cores: with --stack vllm or up" in capsys.readouterr().err


def test_the_up_stacks_targets_judge_every_phase_against_target_only_and_uncovered_ones_against_frozen():
    rows, slot = [], 0
    plan = [("code", 36, 36), ("math", 30, 8), ("code", 35, 36)]  # (domain, online accepted, frozen accepted) of 40 drafted
    for phase, (domain, online, frozen) in enumerate(plan):
        for _ in range(3):
            rows.append(s(slot, phase=phase, domain=domain, accepted=online, tokens=30, seconds=1.0))
            rows.append(s(slot, "frozen", phase=phase, domain=domain, accepted=frozen, tokens=30, seconds=1.2))
            rows.append(s(slot, "plain", phase=phase, domain=domain, accepted=0, k=0, version=None, tokens=30, seconds=1.1))
            slot += 1
    summary = drift.summarize(rows, ["code", "math", "code"], window=20, targets=drift.UP_TARGETS[1],
                              covered={"code", "prose", "qa", "markdown"})
    names = [c["target"] for c in summary["targets"]]
    assert [n.split(":")[0] for n in names] == ["phase 0 (code)", "phase 1 (math)", "phase 1 (math)", "phase 1 (math)",
                                                "phase 1 (math)", "phase 2 (code)", "phase 2 (code)", "phase 2 (code again)"]
    assert "online / target-only >= 1.25" in names[0] and "online - frozen >= 0.1" in names[2]
    by = {n: c for n, c in zip(names, summary["targets"])}
    gain = by["phase 1 (math): acceptance online - frozen >= 0.1 (last third)"]
    assert gain["measured"] == pytest.approx((30 - 8) / 40) and gain["ok"]
    assert not summary["targets"][0]["ok"] and summary["targets"][0]["measured"] == pytest.approx(1.1)  # 1.1x < 1.25x
    batch8 = drift.summarize(rows, ["code", "math", "code"], window=20, targets=drift.UP_TARGETS[8],
                             covered={"code", "prose", "qa", "markdown"})
    assert batch8["targets"][0]["ok"]  # 1.1x >= 1.0x


def test_the_serial_replay_sends_a_sides_batch_together_and_calls_turn_of_before_each_turn(monkeypatch):
    events = []

    def ask(base, prompt, max_tokens, model=None):
        events.append(("ask", base, prompt.text))
        stats = {"rounds": 10, "drafted": 20, "accepted": 10}
        return {"usage": {"completion_tokens": 16}, **({} if model else {"dvi": {"stats": stats}})}, 0.5

    monkeypatch.setattr(drift, "ask", ask)
    slept = []
    monkeypatch.setattr(drift.time, "sleep", slept.append)
    opt = drift.Options(schedule=["code", "math"], rounds=40, serial=True, batch=3, plain_every=2)
    urls = {"online": "o", "frozen": "f", "plain": "p"}
    samples = drift.replay(urls, opt, say=lambda _: None, models={"plain": "m"},
                           turn_of=lambda side: events.append(("turn", side)))
    turns = [e[1] for e in events if e[0] == "turn"]
    # per phase two groups of three prompts (40 online rounds: 10 a request); the order turns; plain every 2nd group
    assert turns == ["online", "frozen", "plain", "frozen", "online", "plain", "online", "frozen", "frozen", "online"]
    first = events[: 4 * 3]
    assert [e[0] for e in first] == ["turn", "ask", "ask", "ask"] * 3 and {e[1] for e in first[1:4]} == {"o"}
    assert {e[2] for e in first[1:4]} == {e[2] for e in first[5:8]} == {e[2] for e in first[9:12]}  # the same batch
    assert sorted({x.slot for x in samples if x.side == "plain"}) == [0, 1, 2, 6, 7, 8]
    assert len([x for x in samples if x.side == "online"]) == 12 and {x.domain for x in samples if x.phase == 1} == {"math"}
    assert slept == [drift.PEER_SPIN_S] * 2  # after each of plain vLLM's turns: its readers spin on
    events.clear()
    monkeypatch.setattr(drift.time, "sleep", lambda seconds: events.append(("pause", seconds)))
    drift.replay(urls, drift.Options(schedule=["code"], rounds=20, serial=True, batch=1, paced=True), say=lambda _: None,
                 models={"plain": "m"}, turn_of=lambda side: events.append(("turn", side)))
    # paced: each online turn (two prompts of 10 rounds) followed by the client's pause, before the next side's turn;
    # each of plain vLLM's by PEER_SPIN_S
    kinds = [e[0] if e[0] != "turn" else e[1] for e in events]
    assert kinds == ["online", "ask", "pause", "frozen", "ask", "plain", "ask", "pause", "frozen", "ask", "online", "ask", "pause"]
    assert all(e[1] >= 0 for e in events if e[0] == "pause") and events[7] == ("pause", drift.PEER_SPIN_S)


def test_batch_and_pause_need_the_serial_replay_and_the_up_stack_runs_no_experiment(capsys):
    opt = drift.options_of(drift.build_parser().parse_args(["--stack", "up", "--serial", "--batch", "8", "--pause-trainer",
                                                            "--trainer-cores", "1", "--domains", "code,math"]))
    assert (opt.stack, opt.batch, opt.pause_trainer, opt.schedule) == ("up", 8, True, ["code", "math"])
    assert drift.STACKS["up"] is None
    assert drift.options_of(drift.build_parser().parse_args(["--serial", "--paced"])).paced
    for bad in (["--batch", "8"], ["--pause-trainer"], ["--paced"]):
        assert drift.main(bad) == 2
        assert "with --serial" in capsys.readouterr().err
