"""The claims a study tests, numbered as arXiv 2608.27351 numbers them, then our own (8+, labelled "ours").

Each claim is a section of the verdict table: its checks (`deltalens.study.checks`) and a verdict, the
agreement of its checks after Holm's adjustment over the whole study. A paper claim whose runs the study
did not make (claims 6 and 7 need --population-sizes / --two-point) is listed as "not run" with the
option that runs it, so the table always shows all seven.
"""

from __future__ import annotations

from deltalens.study.checks import claim_verdict

CLAIMS = {
    1: "GRPO raises Pass@1 but lowers Pass@16/32 and loses problems the base solved; ES raises Pass@1 and keeps "
       "Pass@16/32",
    2: "ES moves 40-44x farther from initialization than GRPO (rel. L2)",
    3: "most of the Pass@1 gain survives high sparsity (one global τ), more than at equal sparsity by a "
       "random mask or at equal norm by a uniform shrink",
    4: "ES's top changes sit in norm weights and attention, GRPO's in embeddings and the LM head",
    5: "ES->GRPO gives the best Pass@32 and keeps most of GRPO's Pass@1 gain",
    6: "the population size N that ES needs shrinks with model scale (here: the smallest N reaching most of the "
       "reference population's gain on this model)",
    7: "two-point ES (one antithetic pair) gives no advantage over N=16 at equal FLOPs",
    8: "(ours) GRPO collapses token entropy, ES does not",
    9: "(ours) the ES population is diverse (JS > 0)",
    10: "(ours) the ES population's members cover more problems than its centre",
}
PAPER_CLAIMS = (1, 2, 3, 4, 5, 6, 7)
NOT_RUN = {6: "not run (use --population-sizes 4,8,16)", 7: "not run (use --two-point)"}
# claims a piece run with --no-first-run-measures leaves to the piece that holds the first seeds
FIRST_RUN_NOT_RUN = {c: "not measured in this piece (--no-first-run-measures): `deltalens study merge` takes it "
                        "from the piece with the first seeds" for c in (3, 9, 10)}

SEED_SPREAD = ("Seed spread: the checks of claims 1, 2, 4, 5, 6, 7 and 8 carry the spread over training seeds (a "
               "Student-t seed part in the bootstrap, or a t interval over per-seed values; none for a method "
               "trained with one seed); the checks of claims 3, 9 and 10 measure the first seed's runs only "
               "(sparsity of es/grpo seed 0, the population of es seed 0), so their intervals are over test "
               "problems or prompts: what one run can tell, not what another seed would give. Claim 7's "
               "paired-reward correlation (shown, not part of its verdict) is over the training iterations of "
               "the two-point runs, resampled within each run: not a seed spread either.")


def temperature_text(temps, verdict_t: float) -> str:
    """Which temperature the verdicts use, and why."""
    if len(temps) == 1:
        return f"Evaluations at T={verdict_t:g}."
    others = ", ".join(f"T={t:g}" for t in temps if t != verdict_t)
    return (f"Claim 1's verdict uses T={verdict_t:g} (the paper's setting, when evaluated); its checks at {others} "
            "are shown beside, tested and Holm-adjusted with the rest but not part of the claim's verdict: a "
            "cold base (low temperature) can make a trained model look like it raises Pass@K where the base "
            "sampled warmer would solve as much. Every other measurement uses T=" f"{verdict_t:g}.")


def claims_of(checks: list[dict], *, ran: set[int] | None = None, not_run: dict | None = None) -> list[dict]:
    """The verdict table's sections: every claim with checks, and paper claims 6 and 7 as "not run" when
    their runs are absent (and those of `not_run`: claim -> note). A check with `"in_verdict": False` (another
    temperature; claim 7's paired-reward correlation) is shown, not counted."""
    notes = {**NOT_RUN, **(not_run or {})}
    out = []
    for cid, title in CLAIMS.items():
        mine = [c for c in checks if c["claim"] == cid]
        if mine:
            counted = [c for c in mine if c.get("in_verdict", True)] or mine
            out.append({"id": cid, "title": title, "checks": mine, "verdict": claim_verdict(counted),
                        "ours": cid not in PAPER_CLAIMS})
        elif cid in notes and (ran is None or cid not in ran):
            out.append({"id": cid, "title": title, "checks": [], "verdict": "not run", "note": notes[cid],
                        "ours": cid not in PAPER_CLAIMS})
    return out
