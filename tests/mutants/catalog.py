"""The planted bugs of ``tests/mutants/run.py``: each one an exact replacement (anchor found exactly
once, or the run fails) in one file, with the tests that must catch it and why it matters.

Anchors are short single lines where possible, so that unrelated edits of a file do not rot them;
when a file is rewritten, fix the anchor here (the runner names the mutant whose anchor moved).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mutant:
    name: str
    file: str  # relative to the repository root
    replace: tuple[tuple[str, str], ...]  # (anchor, replacement), each anchor exactly once
    tests: tuple[str, ...]  # pytest node ids (files or ::tests) that must fail
    why: str


E = "tests/engine/"
P = "tests/privacy/"
D = "tests/distributed/"
R = "tests/reliability/"
S = "tests/sweep/"
Q = "tests/report/"
M = "tests/eval/test_metric_pins.py::"

MUTANTS: list[Mutant] = [
    Mutant("noise-sigma-not-sigma-C", "cluster_fl/engine/round.py",
           (("stds[g.name] = p.sigma * p.clip_norm",
             "stds[g.name] = p.sigma"),),
           (E + "test_round_engine.py::test_released_noise_scales_with_the_clip_norm_at_c_one_half",),
           "update noise std σ instead of σ·C: under-noised whenever C > 1"),
    Mutant("noise-on-every-rank", "cluster_fl/engine/round.py",
           (("if self.comm.rank == 0:  # the noise step", "if True:  # the noise step"),),
           (E + "test_round_engine.py::"
            "test_two_ranks_split_the_cohort_and_release_the_same_noise_as_one_process",),
           "every rank adds the noise: W× the variance, and 1 vs N ranks differ"),
    Mutant("realised-denominator", "cluster_fl/engine/round.py",
           (("mean = {g.name: noised[g.name] / denom for g in self.groups}",
             "mean = {g.name: noised[g.name] / max(len(members), 1) for g in self.groups}"),),
           (E + "test_round_engine.py", E + "test_weighting.py"),
           "divides by the realised cohort size, not the public q·N: the denominator leaks"),
    Mutant("weight-uncapped", "cluster_fl/engine/round.py",
           (("return min(n_samples, agg.weight_cap) / agg.weight_cap",
             "return n_samples / agg.weight_cap"),),
           (E + "test_weighting.py",),
           "sample weighting without the cap: one client's weight (and sensitivity) unbounded"),
    Mutant("ledger-two-rounds-per-round", "cluster_fl/engine/ledger.py",
           (("        if self.secure or round_ > self.started:\n            self.ledger.step(self.policy)",
             "        if self.secure or round_ > self.started:\n"
             "            self.ledger.step(self.policy, rounds=2)"),),
           (R + "test_ledger.py::"
            "test_epsilon_in_privacy_json_and_rows_is_the_accountants_for_the_rounds_run",),
           "each round charged twice: ε overstated (the run-vs-run tests carry it on both sides)"),
    Mutant("ledger-recharge-on-resume", "cluster_fl/engine/ledger.py",
           (("if self.secure or round_ > self.started:", "if self.secure or round_ >= self.started:"),),
           (R + "test_ledger.py",),
           "a research rerun charges the round it already charged: ε of a resumed run differs"),
    Mutant("clip-margin-sign", "cluster_fl/privacy/clipping.py",
           (("f = pool_thr[pool.name] / pn * (1.0 - MARGIN) if hit else 1.0",
             "f = pool_thr[pool.name] / pn * (1.0 + MARGIN) if hit else 1.0"),),
           (P + "test_clipping.py::test_flat_is_global_scaling",),
           "a clipped flat pool lands just ABOVE its threshold: ‖clipped‖ ≤ C broken"),
    Mutant("clip-unit-hit-at-2C", "cluster_fl/privacy/clipping.py",
           (("hit = unit_norms[u] > unit_thr[u]", "hit = unit_norms[u] > 2 * unit_thr[u]"),),
           (P + "test_clipping.py::test_a_unit_just_over_its_threshold_is_clipped_to_it_and_only_it",),
           "a unit is clipped only above twice its threshold: the bound is 2·C_u"),
    Mutant("alpha-split-swapped", "cluster_fl/privacy/clipping.py",
           (('("encoder", lambda g: g.component == "encoder", cfg.alpha),',
             '("encoder", lambda g: g.component == "encoder", 1.0 - cfg.alpha),'),
            ('("decoder", lambda g: g.component != "encoder", 1.0 - cfg.alpha)]',
             '("decoder", lambda g: g.component != "encoder", cfg.alpha)]')),
           (P + "test_clipping.py",
            E + "test_round_engine.py::test_one_client_scaled_by_1e6_moves_each_pool_by_at_most_its_share",
            E + "test_round_engine_real_names.py::"
            "test_alpha_split_moves_each_pool_by_at_most_its_share_on_real_names"),
           "α-split gives the encoder 1−α and the decoder α"),
    Mutant("pool-threshold-not-sqrt", "cluster_fl/privacy/clipping.py",
           (("return {p.name: self.clip_norm * self._kappa * math.sqrt(p.share) for p in self._pools}",
             "return {p.name: self.clip_norm * self._kappa * p.share for p in self._pools}"),),
           (P + "test_clipping.py",),
           "pool thresholds C·α instead of C·√α: Σ C_k² ≠ C²"),
    Mutant("secure-sum-masks-added-twice", "cluster_fl/secure_sum.py",
           (("np.subtract(part, mask, out=part)", "np.add(part, mask, out=part)"),),
           (D + "test_secure_sum_units.py::test_research_masks_of_four_ranks_cancel_mod_2_64",
            D + "test_secure_sum_ranks.py::test_secure_sum_equals_plain_fixed_point_sum_exactly"),
           "both ends of a pair add the mask: the masks no longer cancel"),
    Mutant("secure-sum-pair-key-order", "cluster_fl/secure_sum.py",
           (("lo, hi = min(rank, peer), max(rank, peer)", "lo, hi = rank, peer"),),
           (D + "test_secure_sum_units.py::test_research_masks_of_four_ranks_cancel_mod_2_64",),
           "the two ends of a pair derive different masks: the sum is garbage"),
    Mutant("adaptive-ema-not-resumed", "cluster_fl/privacy/adaptive.py",
           (('self.ema = None if state["ema"] is None else [float(x) for x in state["ema"]]',
             "self.ema = None"),),
           (P + "test_adaptive.py", E + "test_resume.py"),
           "a resumed run forgets the EMA of the adaptive weights: not the uninterrupted run"),
    Mutant("batched-divisor-block-max", "cluster_fl/engine/batched.py",
           (("weight = _on_device([1.0 / n_tok[j] if r else 0.0 for j, r in zip(owners, real)],",
             "weight = _on_device([1.0 / max(n_tok.values()) if r else 0.0 "
             "for j, r in zip(owners, real)],"),),
           (E + "test_batched.py::test_each_client_in_a_block_gets_its_one_client_update",),
           "a client's loss in a block divided by the block's largest token count, not its own"),
    Mutant("eval-gather-order", "cluster_fl/engine/evaluation.py",
           (("key=lambda pair: pair[0])]", "key=lambda pair: -pair[0])]"),),
           (E + "test_evaluation.py::test_rank_0_puts_the_gathered_rows_back_in_the_evaluation_sets_order",),
           "evaluation rows gathered from the ranks come back in reverse set order"),
    Mutant("preempted-not-requeued", "cluster_fl/sweep/grid.py",
           (('if type(exc).__name__ == "Preempted":', 'if type(exc).__name__ == "Preempted!":'),),
           (S + "test_grid.py::"
            "test_a_run_preempted_on_the_local_cluster_is_requeued_and_resumes_from_its_folder",),
           "a preempted grid task is recorded as failed instead of requeued"),
    Mutant("stale-heartbeat-is-running", "cluster_fl/sweep/status.py",
           (('if state == "running" and alive is None and _age_s(status) < stale_s:',
             'if state == "running" and alive is None and _age_s(status) >= stale_s:'),),
           (S + "test_slurm.py::test_a_running_folder_whose_job_cannot_be_asked_is_judged_by_its_heartbeat",),
           "requeue/resubmit decision: a stale run is judged running and never resubmitted"),
    Mutant("diagnostics-noise-not-scaled", "cluster_fl/privacy/diagnostics.py",
           (("self.noise_std = multiplier * self.sensitivity if multiplier is not None else 0.0",
             "self.noise_std = multiplier if multiplier is not None else 0.0"),),
           (P + "test_diagnostics.py",),
           "diagnostics noise std z instead of z·√D: under-noised by √D"),
    Mutant("ledger-sampling-rate-halved", "cluster_fl/privacy/accounting.py",
           (("sampling_rate=m / population,", "sampling_rate=m / population / 2,"),),
           (R + "test_ledger.py::"
            "test_epsilon_in_privacy_json_and_rows_is_the_accountants_for_the_rounds_run",),
           "the ledger charges q/2: ε understated (amplification by sampling overclaimed)"),
    Mutant("cohort-same-every-round", "cluster_fl/engine/cohort.py",
           (('g = generator(seed, "cohort", round_)', 'g = generator(seed, "cohort", 0)'),),
           (E + "test_cohort.py",),
           "the same cohort every round: the accountant's fresh sampling does not happen"),
    Mutant("poisson-rate-halved", "cluster_fl/engine/cohort.py",
           (("dtype=torch.float64) < q", "dtype=torch.float64) < q / 2"),),
           (E + "test_cohort.py",),
           "clients included at q/2 while the ledger and the denominator assume q"),
    Mutant("block-clipped-with-first-clients-norms", "cluster_fl/privacy/clipping.py",
           (("return [self._clip_one(u, tops[i * g:(i + 1) * g], norm_list[i * g:(i + 1) * g])",
             "return [self._clip_one(u, tops[0:g], norm_list[0:g])"),),
           (P + "test_host_reads.py::test_a_block_is_clipped_as_its_clients_one_by_one_with_one_read",),
           "a block's clients clipped with the first client's norms: a big update passes unclipped"),
    Mutant("block-add-counts-one", "cluster_fl/secure_sum.py",
           (("self._acc[self.numel + self._index[name]] += len(parts)",
             "self._acc[self.numel + self._index[name]] += 1"),),
           (P + "test_host_reads.py::test_a_block_adds_the_same_integers_as_its_clients_one_by_one",),
           "a block of K contributions counted as one in the secure sum's counters"),
    Mutant("deferred-check-adds-a-failing-call", "cluster_fl/secure_sum.py",
           (("        return (~bad.any()).to(torch.int64)",
             "        return torch.ones((), dtype=torch.int64, device=dev)"),),
           (P + "test_host_reads.py::test_a_deferred_range_check_reads_nothing_adds_nothing_and_"
            "fails_the_reduce",),
           "the engine's on-device range check adds a contribution beyond its bound anyway"),
    Mutant("deferred-check-forgets-the-failure", "cluster_fl/secure_sum.py",
           (('        faults.scatter_reduce_(0, where, worst, "amax")', "        pass"),),
           (P + "test_host_reads.py::test_a_deferred_range_check_reads_nothing_adds_nothing_and_"
            "fails_the_reduce",),
           "a contribution beyond its bound is dropped silently: the round's reduce never fails"),
    Mutant("decode-static-hides-own-slot", "cluster_fl/models/decoding.py",
           (("(slot[None, None, :] <= slot[None, :, None])",
             "(slot[None, None, :] < slot[None, :, None])"),),
           ("tests/models/test_decoding.py::test_static_equals_dynamic_token_for_token",),
           "the static cache's step does not attend to its own token: other transcripts"),
    Mutant("decode-static-reads-every-token", "cluster_fl/models/decoding.py",
           (("((t + 1) % SYNC_EVERY == 0 and bool(done.all()))", "bool(done.all())"),),
           ("tests/models/test_decoding.py::"
            "test_static_decode_reads_the_device_every_sync_every_tokens",),
           "the static path syncs with the host every token (a GPU stall per token) again"),
    Mutant("malloc-preloads-again", "cluster_fl/malloc.py",
           (("    if any(name in preloaded for name in _ALLOCATORS):",
             "    if False:"),),
           ("tests/commands/test_malloc.py::"
            "test_preload_goes_first_and_an_allocator_already_preloaded_is_left_alone",),
           "the re-executed CLI preloads again and re-executes forever (or overrides the "
           "user's own allocator)"),
    Mutant("run-dies-silently", "cluster_fl/engine/train.py",
           (("    dump_stacks_on_fatal_signal()\n", ""),),
           (E + "test_fatal_signal.py::test_a_segfault_in_a_run_prints_the_python_stack",),
           "a segfault inside a compiled kernel ends a run with no trace of where"),
    Mutant("resume-on-another-model", "cluster_fl/engine/provenance.py",
           (("        if first != sha:", "        if False:"),),
           (E + "test_provenance.py::"
            "test_the_first_attempt_fixes_the_starting_model_and_a_changed_one_is_refused",),
           "a run resumed where its checkpoint was rebuilt (another CPU: another model) goes on "
           "from other weights than it began with"),
    Mutant("round0-cache-ignores-the-bytes", "cluster_fl/report/round0.py",
           (("        cached = False  # scored on other bytes", "        pass  # scored on other bytes"),),
           (Q + "test_round0.py::"
            "test_a_cached_score_of_other_bytes_under_the_same_checkpoint_is_redone",),
           "round-0 keeps the score of a starting model the study no longer uses"),
    Mutant("demo-trusts-a-changed-starting-model", "cluster_fl/commands/demo.py",
           (("    if want is None or got != want:", "    if want is None:"),),
           ("tests/commands/test_demo_starting_model.py::"
            "test_a_cached_copy_with_other_bytes_is_refused",
            "tests/commands/test_demo_starting_model.py::"
            "test_a_committed_model_that_does_not_match_its_sums_is_refused"),
           "the demo starts from whatever bytes sit in the cache, not the committed model"),
    Mutant("demo-pretrains-despite-a-committed-model", "cluster_fl/commands/demo.py",
           (("    committed = None if own else committed_starting_model(",
             "    committed = None if True else committed_starting_model("),),
           ("tests/commands/test_demo_starting_model.py::"
            "test_the_demo_takes_the_committed_model_unless_asked_to_pretrain",),
           "the demo draws its own starting model again: another CPU, another verdict"),
    Mutant("findings-equivalence-without-the-margin", "cluster_fl/report/findings.py",
           (("    if -margin < low and high < margin:",
             "    if True:"),),
           (Q + "test_findings.py::test_finding_c_is_an_equivalence_test",),
           "a 'within noise' verdict is read as α-split reproducing flat, however wide its CI "
           "(PROTOCOL §1's 0.02 margin)"),
    # the metric: text normalisation on both sides of the WER, the speaker-clustered interval
    Mutant("wer-hypothesis-not-normalised", "cluster_fl/eval/evaluate.py",
           (('ref, hyp = normalize_text(_field(u, "transcript", "text")), normalize_text(hyp)',
             'ref, hyp = normalize_text(_field(u, "transcript", "text")), hyp'),),
           (M + "test_the_hypothesis_is_normalised_like_the_reference",),
           "the decoder's raw text is scored against a normalised reference: case and "
           "punctuation count as word errors"),
    Mutant("wer-reference-not-normalised", "cluster_fl/eval/evaluate.py",
           (('ref, hyp = normalize_text(_field(u, "transcript", "text")), normalize_text(hyp)',
             'ref, hyp = str(_field(u, "transcript", "text")), normalize_text(hyp)'),),
           (M + "test_the_reference_is_normalised_like_the_hypothesis",),
           "an MLS transcript's case and punctuation count against every hypothesis"),
    Mutant("normalise-keeps-case", "cluster_fl/data/vocab.py",
           (('text = unicodedata.normalize("NFC", text).lower()',
             'text = unicodedata.normalize("NFC", text)'),),
           (M + "test_normalisation_by_rule",),
           "'The' and 'the' are different words"),
    Mutant("normalise-without-nfc", "cluster_fl/data/vocab.py",
           (('text = unicodedata.normalize("NFC", text).lower()', "text = text.lower()"),),
           (M + "test_composed_and_decomposed_accents_are_the_same_word",),
           "a composed and a decomposed é are different characters: accented words count as errors"),
    Mutant("normalise-splits-inner-apostrophes", "cluster_fl/data/vocab.py",
           (("text = re.sub(r\"(?<!\\w)'|'(?!\\w)\", \" \", text)", "text = text.replace(\"'\", \" \")"),),
           (M + "test_apostrophes_inside_words_count_and_quotes_do_not",
            M + "test_normalisation_by_rule"),
           "\"don't\" becomes two words: the reference's word count and its errors change"),
    Mutant("ci-resamples-utterances", "cluster_fl/eval/metrics.py",
           (('cluster: str = "speaker", errors: str = "word_errors",',
             'cluster: str = "utt_id", errors: str = "word_errors",'),),
           (M + "test_the_reported_interval_resamples_speakers_not_utterances",),
           "the reported CI resamples correlated utterances as if independent: too narrow"),
    Mutant("ci-mean-of-speaker-rates", "cluster_fl/eval/metrics.py",
           (("stats = np.where(den > 0, num / np.maximum(den, 1e-12), np.nan)",
             "stats = (err[idx] / np.maximum(tot[idx], 1e-12)).mean(axis=1)"),),
           (M + "test_each_resample_pools_errors_over_words_not_a_mean_of_speaker_rates",
            M + "test_the_interval_is_the_specified_speaker_bootstrap_exactly"),
           "a resample's WER is a mean of speakers' rates, not the pooled WER the table reports"),
    Mutant("ci-90-percent", "cluster_fl/eval/metrics.py",
           (("tail = (1.0 - level) / 2.0 * 100.0", "tail = (1.0 - level) * 100.0"),),
           (M + "test_the_interval_is_95_percent_two_sided",),
           "a 90% interval reported as a 95% one"),
    Mutant("ci-without-replacement", "cluster_fl/eval/metrics.py",
           (("idx = rng.integers(0, len(err), size=(n_resamples, len(err)))",
             "idx = np.array([rng.permutation(len(err)) for _ in range(n_resamples)])"),),
           (M + "test_draws_are_with_replacement",),
           "speakers drawn without replacement: every draw is the whole set, the CI a point"),
    Mutant("findings-trust-a-3-seed-bootstrap", "cluster_fl/report/findings.py",
           (("        if self.n_seeds >= MIN_BOOTSTRAP_SEEDS:", "        if True:"),),
           (Q + "test_findings.py::"
            "test_with_fewer_than_five_seeds_c_judges_the_t_interval_recovered_from_delta_and_p",),
           "an equivalence finding decided on a percentile bootstrap of three seeds"),
    Mutant("findings-trust-the-verdict-column", "cluster_fl/report/findings.py",
           (("        if self.p_holm < LEVEL:",
             "        return self.verdict\n        if self.p_holm < LEVEL:"),),
           (Q + "test_findings.py::test_a_verdict_column_that_contradicts_delta_and_p_is_not_trusted",),
           "a verdict column that contradicts its Δ and p decides the finding"),
    Mutant("peers-compared-in-fp32-only", "bench/peers/run.py",
           (('        return ["fp32", "bf16"] if device == "cpu" else ["bf16"]',
             '        return ["fp32"] if device == "cpu" else ["bf16"]'),),
           ("tests/bench/test_peers_smoke.py::test_default_matrix_is_the_benchmarks",),
           "the peers run only in fp32 on a CPU, where their bf16 loop can be faster: the "
           "ratio is against a handicapped peer"),
    Mutant("peers-unequal-local-steps", "bench/peers/common.py",
           (('        "fl.local_epochs": work.local_epochs,\n', ""),),
           ("tests/bench/test_peers_smoke.py::"
            "test_cluster_fl_takes_the_same_local_steps_as_the_peers",),
           "cluster_fl takes fewer local steps than the peers: the speed ratio compares "
           "unequal work"),
    Mutant("checkpoint-unpickles-code", "cluster_fl/engine/checkpoint.py",
           (('weights_only=True)  # no code runs', 'weights_only=False)  # no code runs'),),
           (R + "test_trust.py::"
            "test_a_checkpoint_that_carries_code_is_refused_and_the_code_never_runs",),
           "a resume unpickles state.pt before any check: a crafted checkpoint runs a command"),
    Mutant("secure-run-evaluates-on-clients", "cluster_fl/engine/setup.py",
           (("    if cfg.privacy.secure_mode:\n        raise UserError(f\"data.eval_split: ",
             "    if False:\n        raise UserError(f\"data.eval_split: "),),
           (P + "test_release_scope.py::"
            "test_evaluation_speakers_that_are_clients_are_refused_in_secure_mode_and_void_otherwise",),
           "a secure run evaluates on its clients' speakers and records 'valid' while "
           "eval.parquet holds their transcripts and exact errors"),
    Mutant("resume-ignores-the-nonce", "cluster_fl/engine/checkpoint.py",
           (('    if check_nonce and ckpt.get("run_nonce") != nonce:',
             '    if False:'),),
           (R + "test_trust.py::test_another_runs_checkpoint_and_ledger_copied_in_are_refused",),
           "another run's state.pt with the same config, copied in, is resumed as this run's"),
    Mutant("placeholder-corpus-queued", "cluster_fl/sweep/preflight.py",
           (("        found += check_inputs(specs)", "        found += []"),),
           (S + "test_preflight.py::"
            "test_a_placeholder_corpus_is_one_line_and_exit_2_with_nothing_submitted",),
           "pre-flight checks no input: a grid with /path/to/... as its corpus reaches the queue"),
    Mutant("lane-loss-over-the-slice", "cluster_fl/distributed/parallelize.py",
           (('total = max(sum(model.target_counts(batch["texts"])), 1)',
             'total = max(sum(model.target_counts(part["texts"])), 1)'),),
           (E + "test_lane_syncs.py::"
            "test_a_lane_step_reads_nothing_back_and_equals_the_unsharded_step",),
           "a lane member divides its loss by its own slice's tokens, not the batch's: the lane's "
           "gradient is about G x too large"),
    Mutant("encoder-input-transposed", "cluster_fl/models/speech_llm.py",
           (("        x = nn.functional.gelu(enc.conv2(x)).permute(0, 2, 1).contiguous()\n"
             "        x = x + enc.embed_positions.weight.index_select(",
             "        x = nn.functional.gelu(enc.conv2(x)).permute(0, 2, 1)\n"
             "        x = x + enc.embed_positions.weight.index_select("),),
           (E + "test_compiled_step.py::"
            "test_one_row_steps_train_as_the_eager_step_and_read_nothing_back",),
           "the encoder's layers get the convolutions' transposed view: a compiled step's encoder "
           "gradient of a one-utterance batch is 1-2% off"),
    Mutant("compile-whatever-the-length", "cluster_fl/precision.py",
           (("    return lane_steps is not None and lane_steps >= COMPILE_PAYS_AFTER_STEPS",
             "    return True"),),
           ("tests/config/test_precision.py::"
            "test_auto_compiles_on_a_cpu_without_fast_bf16_when_the_run_repays_it",),
           "a CPU without fast bf16 compiles a short run: ~40 s of compile for a step no faster"),
]
