"""LLMEngine: tokenizer + scheduler + KV cache manager + model runner, driven one step at a time.

`step()` schedules a batch, runs it, applies the outputs and turns them into StepOutputs
(detokenized text, stop strings). The engine is synchronous; AsyncLLMEngine runs it in a
thread for the servers.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Any

from pdserve.engine.beam_search import BeamSearch
from pdserve.engine.config import EngineConfig
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.lora.manager import resolve_lora
from pdserve.engine.lora.request import LoRARequest
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.output_state import OutputState, cut_at_stop_string, replay, stop_holdback
from pdserve.engine.outputs import EngineStats, FirstToken, Logprob, Resume, StepOutput
from pdserve.engine.parallel.launcher import engine_threads
from pdserve.engine.prompt_logprobs import prompt_logprobs_output
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.request_checks import check_new_request
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.scheduler_output import ModelRunnerOutput
from pdserve.engine.structured_output import StructuredOutputManager
from pdserve.engine.token_masks import bad_words_token_ids
from pdserve.engine.tokenizer import IncrementalDetokenizer, eos_token_id, load_tokenizer

if TYPE_CHECKING:
    from pdserve.engine.kv_connector import ConnectorFactory

logger = logging.getLogger(__name__)

_IDLE_POLL_S = 0.001  # a step with nothing schedulable waits this long before polling the store I/O again


class LLMEngine:
    def __init__(self, config: EngineConfig, connector_factory: ConnectorFactory | None = None) -> None:
        """`connector_factory` builds the KV connector when `config.kv_transfer` asks for one.

        The engine knows only the connector interface (engine.kv_connector); the layer above picks
        the implementation (serving passes connectors.factory.create_connector).
        """
        self.config = config
        self.model_name = config.model.model
        self.threads = engine_threads(config)  # torch threads before the first parallel op, on the step thread
        self.model_runner = ModelRunner(config, connector_factory=connector_factory)  # first: explains a bad path
        logger.info("%s", self.threads.line())  # once the model loaded: a start-up failure stays one line
        self.tokenizer = load_tokenizer(config.model.model)
        runner = self.model_runner
        connector = None
        if config.kv_transfer.enabled:
            if connector_factory is None:
                raise ValueError("kv_store / lmcache_config need a KV connector: build the engine through "
                                 "serving (serving.LLM, pd-prefill, pd-decode), which supplies one")
            # The runner comes first (the connector needs its shapes and registers its KV tensors).
            connector = runner.make_connector(connector_factory)
            runner.connector = connector
        self.connector = connector
        self.kv_cache_manager = KVCacheManager(runner.num_blocks, runner.block_size, runner.fingerprint,
                                               config.cache.enable_prefix_caching)
        capacity = runner.num_blocks * runner.block_size
        # One request can never hold more tokens than the whole cache: cap instead of preempting forever.
        self.max_model_len = min(runner.max_model_len, capacity)
        if capacity < runner.max_model_len:
            logger.warning("KV cache holds %d tokens, less than the model's %d: max_model_len capped to %d "
                           "(raise kv_cache_memory for longer sequences)", capacity, runner.max_model_len, capacity)
        self.scheduler = Scheduler(config, self.kv_cache_manager, connector, max_model_len=self.max_model_len)
        self.vocab_size = runner.vocab_size
        self.eos_token_id = eos_token_id(self.tokenizer, runner.hf_config)
        self.structured_output = StructuredOutputManager(self.tokenizer, self.vocab_size, self.eos_token_id)
        self._states: dict[str, OutputState] = {}  # engine request id (one per choice) -> output state
        self._groups: dict[str, list[str]] = {}  # the caller's request id -> its choices' engine ids
        # Outputs made outside a step (a given first token): the next step returns them first.
        self._ready: list[StepOutput] = []
        self.num_requests_added = 0
        self.num_requests_finished = 0
        self.num_generation_tokens = 0
        sc = config.scheduler
        logger.info("engine ready: model %s (%s, %s, %d layers, %d kv heads x %d head dim) on %s, attention %s, "
                    "%d KV blocks x %d tokens = %d tokens, max_model_len %d, max_num_seqs %d, "
                    "max_num_batched_tokens %d, long_prefill_token_threshold %d, prefix caching %s, connector %s",
                    self.model_name, type(runner.hf_config).__name__.removesuffix("Config"),
                    str(runner.dtype).removeprefix("torch."),
                    runner.num_layers, runner.num_kv_heads, runner.head_dim, runner.platform.describe(),
                    runner.attn_backend.name, runner.num_blocks, runner.block_size,
                    capacity, self.max_model_len, sc.max_num_seqs, sc.max_num_batched_tokens,
                    sc.long_prefill_token_threshold, "on" if config.cache.enable_prefix_caching else "off",
                    type(connector).__name__ if connector is not None else "none")

    @classmethod
    def from_kwargs(cls, model: str, connector_factory: ConnectorFactory | None = None, **kwargs: Any) -> LLMEngine:
        return cls(EngineConfig.from_kwargs(model, **kwargs), connector_factory)

    # ---- requests ----
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams | None = None,
                    cache_salt: str | None = None, arrival_time: float | None = None,
                    resume: Resume | None = None, first_token: FirstToken | None = None,
                    lora_request: LoRARequest | None = None) -> None:
        """Queue a request; ValueError with a clear message when it can never run.

        `lora_request` runs it under that LoRA adapter (loaded on first use; needs enable_lora).

        With n > 1 it becomes n engine requests (choice 0 keeps `request_id`, choice i is
        `{i}_{request_id}` as in vLLM); their outputs carry `request_id` and their `index`.
        `arrival_time` (time.monotonic()) is when the request reached the server, if earlier than now.

        `resume` (n = 1 only) continues a stream that another engine started: its tokens become
        this request's first outputs (recomputed, never re-sent), so the continuation is what the
        uninterrupted request would have produced (greedy, or seeded: the sampler's seed depends
        only on the token position).

        `first_token` (n = 1 only) is the first output token as the P/D prefill node sampled it: it
        goes out at once as this request's first output, and the engine continues from it.
        """
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        if request_id in self._groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        ids = list(prompt_token_ids)
        done = list(resume.output_token_ids) if resume is not None else []
        check_new_request(ids, done, params, resume is not None, first_token, self.max_model_len, self.vocab_size)
        lora = resolve_lora(self.model_runner.lora, lora_request)  # ValueError for an adapter it cannot serve
        if params.bad_words and params.bad_words_token_ids is None:  # once, with this engine's tokenizer
            params = dataclasses.replace(params, bad_words_token_ids=bad_words_token_ids(
                self.tokenizer, params.bad_words, self.vocab_size))
        grammar = params.structured_outputs
        if grammar is not None:
            self.structured_output.compile(grammar)  # ValueError for an invalid spec, before anything is queued
        arrival = time.monotonic() if arrival_time is None else arrival_time
        if params.use_beam_search:  # one sequence: its beams fork from it (engine/beam_search.py)
            beam = dataclasses.replace(params, n=1, temperature=0.0)
            choices = [Request(request_id, ids, beam, eos_token_id=self.eos_token_id, cache_salt=cache_salt,
                               arrival_time=arrival, lora=lora)]
            max_tokens = min(params.max_tokens, self.max_model_len - len(ids))
            BeamSearch(request_id, params.n, params.length_penalty, max_tokens,
                       None if params.ignore_eos else self.eos_token_id).start(choices[0])
        else:
            choices = [Request(request_id if i == 0 else f"{i}_{request_id}", ids, params if params.n == 1 else
                               params.for_choice(i), eos_token_id=self.eos_token_id, cache_salt=cache_salt,
                               parent_id=request_id, index=i, arrival_time=arrival, lora=lora) for i in range(params.n)]
        states = [OutputState(c, IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens))
                  for c in choices]
        if resume is not None:
            replay(states[0], done, resume.num_sent_chars)
        for choice in choices:
            choice.grammar = self.structured_output.request_grammar(grammar)
            # Everything the step will need from this request's parameters is derived here, once: a
            # value the step could not handle fails this request now, never the batch it would join.
            self.model_runner.sampler.prepare(choice)
        choices[0].forks = choices[1:]
        for state in states:
            self._states[state.request.request_id] = state
        self._groups[request_id] = [c.request_id for c in choices]
        if first_token is None:
            self.scheduler.add_request(choices[0])
        else:
            self._take_first_token(states[0], first_token)
        self.num_requests_added += 1
        choices_note = f", n {params.n} (the prompt is computed once)" if params.n > 1 else ""
        if params.use_beam_search:
            choices_note = f", beam search width {params.n} (length_penalty {params.length_penalty:g})"
        logger.info("Reqid: %s, added: prompt %d tokens, max_tokens %d%s%s%s", request_id, len(ids), params.max_tokens,
                    choices_note, f", LoRA adapter {lora.label}" if lora is not None else "",
                    f", resuming after {len(done)} output tokens" if resume is not None else
                    f", first token {first_token.token_id} given" if first_token is not None else "")

    def _take_first_token(self, state: OutputState, first: FirstToken) -> None:
        """Append a given first token as if this engine had sampled it (grammar, stop checks), queue its
        output for the next step, and schedule the request unless that token ended it."""
        request, params = state.request, state.request.sampling_params
        request.first_token_given = True
        top = list(first.top_logprobs or []) if params.top_logprobs or params.logprob_token_ids else None
        request.append_output_token(first.token_id, first.logprob if params.logprobs else None, top)
        if not self.scheduler.check_stop(request, first.token_id):
            self.scheduler.add_request(request)  # before its output: a stop string there ends it in the scheduler
        self._ready.append(self._make_output(request))

    def abort_request(self, request_ids: str | list[str]) -> list[StepOutput]:
        """Abort running or waiting requests, all their choices (unknown ids are ignored); their final outputs."""
        ids = [request_ids] if isinstance(request_ids, str) else request_ids
        choice_ids = [c for rid in ids for c in self._groups.get(rid, [rid])]
        done = self.scheduler.finish_requests(choice_ids, RequestStatus.FINISHED_ABORTED)
        return [self._make_output(r) for r in done]

    def reset_prefix_cache(self) -> bool:
        """vLLM's LLMEngine.reset_prefix_cache: later requests find nothing of earlier ones in this engine's
        paged KV (a KV store keeps its chunks). Between steps only: AsyncLLMEngine runs it on its step thread."""
        forgotten = self.kv_cache_manager.reset_prefix_cache()
        logger.info("prefix cache reset: %d cached blocks forgotten", forgotten)
        return True

    # ---- LoRA adapters (vLLM's add_lora / remove_lora / list_loras) ----
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter now (LoRAError, a ValueError, when it cannot be served)."""
        return resolve_lora(self.model_runner.lora, lora_request) is not None

    def remove_lora(self, lora_int_id: int) -> bool:
        return self.model_runner.lora is not None and self.model_runner.lora.remove(lora_int_id)

    def list_loras(self) -> set[int]:
        return set(self.model_runner.lora.list_ids()) if self.model_runner.lora is not None else set()

    def has_request(self, request_id: str) -> bool:
        """Whether some choice of `request_id` is still queued or running."""
        return request_id in self._groups

    def has_unfinished_requests(self) -> bool:
        return bool(self._ready) or self.scheduler.has_unfinished_requests()

    # ---- one step ----
    def step(self) -> list[StepOutput]:
        """One scheduled batch. With nothing to schedule (every request waits on store I/O) the step
        still polls the connector, then sleeps `_IDLE_POLL_S` so waiting does not spin a core."""
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.total_num_scheduled_tokens or self.connector is not None:
            runner_output = self.model_runner.execute_model(scheduler_output)
        else:
            runner_output = ModelRunnerOutput()
        updated = self.scheduler.update_from_output(scheduler_output, runner_output)
        outputs, self._ready = self._ready, []
        outputs += [out for r in updated if (out := self._output_or_failure(r)) is not None]
        searches, self.scheduler.finished_beam_searches = self.scheduler.finished_beam_searches, []
        for search in searches:
            outputs.extend(self._beam_search_outputs(search))
        if not scheduler_output.total_num_scheduled_tokens and not outputs:
            time.sleep(_IDLE_POLL_S)
        return outputs

    def _output_or_failure(self, request: Request) -> StepOutput | None:
        """The request's output; an unexpected error making it fails this request alone."""
        try:
            return self._make_output(request)
        except Exception as exc:
            logger.exception("Reqid: %s, failed while making its output; failing this request alone",
                             request.request_id)
            return self.fail_request(request.request_id, f"{type(exc).__name__}: {exc}")

    def fail_request(self, request_id: str, error: str) -> StepOutput | None:
        """End one request (one choice's id) with FINISHED_ERROR, its stream gets the error; None if
        it is already gone."""
        done = self.scheduler.finish_requests(request_id, RequestStatus.FINISHED_ERROR)
        if not done:
            return None
        request = done[0]
        request.error = error
        state = self._states.get(request_id)
        if state is not None:
            self._finish(state)
        return StepOutput(request_id=request.parent_id, prompt_token_ids=request.prompt_token_ids,
                          new_token_ids=[], new_text="", new_logprobs=[], token_ids=list(request.output_token_ids),
                          text=state.text if state else "", finished=True, finish_reason="error",
                          num_cached_tokens=max(request.num_cached_tokens, 0), index=request.index, error=error)

    def _make_output(self, request: Request) -> StepOutput:
        state = self._states[request.request_id]
        params = request.sampling_params
        new_ids = request.output_token_ids[state.num_sent_tokens:]
        if new_ids and state.first_token is None:
            state.first_token = time.monotonic()
        self.num_generation_tokens += len(new_ids)
        text_ids = new_ids
        if (new_ids and request.status == RequestStatus.FINISHED_STOPPED and not params.include_stop_str_in_output
                and not isinstance(request.stop_reason, str)):
            text_ids = new_ids[:-1]  # EOS or a stop_token_id ended it: that token is not part of the text (vLLM)
        checked = len(state.text)
        state.text += state.detokenizer.add_tokens(text_ids)
        self._check_stop_strings(state, checked)
        if request.is_finished:
            if not isinstance(request.stop_reason, str):
                state.text += state.detokenizer.flush()
            visible = len(state.text)
        else:  # hold back text that may still become a stop string
            visible = max(state.num_sent_chars, len(state.text) - stop_holdback(request))
        out = StepOutput(
            request_id=request.parent_id,
            prompt_token_ids=request.prompt_token_ids,
            new_token_ids=new_ids,
            new_text=state.text[state.num_sent_chars:visible],
            new_logprobs=request.output_logprobs[state.num_sent_tokens:] if params.logprobs else [],
            token_ids=list(request.output_token_ids) if request.is_finished else [],
            text=state.text[:visible] if request.is_finished else "",
            finished=request.is_finished,
            finish_reason=request.finish_reason,
            num_cached_tokens=request.num_cached_tokens,
            stop_reason=request.stop_reason,
            new_top_logprobs=request.output_top_logprobs[state.num_sent_tokens:],
            index=request.index,
            prompt_logprobs=self._prompt_logprobs(state),
        )
        state.num_sent_tokens = len(request.output_token_ids)
        state.num_sent_chars = visible
        if request.is_finished:
            self._finish(state)
        return out

    def _beam_search_outputs(self, search: BeamSearch) -> list[StepOutput]:
        """A finished beam search's answer: its hypotheses, best first, as choices 0..width-1, whole."""
        state = self._states[search.request_id]
        request, params = state.request, state.request.sampling_params
        outputs = []
        for index, hypothesis in enumerate(search.results()):
            tokens = hypothesis.token_ids
            stopped = tokens[-1] == search.eos_token_id
            detokenizer = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, params.skip_special_tokens)
            text = detokenizer.add_tokens(tokens[:-1] if stopped else tokens) + detokenizer.flush()
            self.num_generation_tokens += len(tokens)
            outputs.append(StepOutput(
                request_id=search.request_id, prompt_token_ids=request.prompt_token_ids, new_token_ids=tokens,
                new_text=text, new_logprobs=[], token_ids=tokens, text=text, finished=True,
                finish_reason="stop" if stopped else "length", num_cached_tokens=request.num_cached_tokens,
                index=index))
        if state.first_token is None:
            state.first_token = time.monotonic()
        request.status = RequestStatus.FINISHED_STOPPED
        self._finish(state)
        logger.info("Reqid: %s, beam search done: %d steps, scores %s", search.request_id, search.num_generated,
                    ", ".join(f"{h.score:.4f}" for h in search.results()))
        return outputs

    def _prompt_logprobs(self, state: OutputState) -> list[dict[int, Logprob] | None] | None:
        """vLLM's prompt_logprobs, built once the whole prompt's are in (engine/prompt_logprobs.py)."""
        request = state.request
        if not request.needs_prompt_logprobs or len(request.prompt_logprobs) < request.num_prompt_tokens - 1:
            return None
        if state.prompt_logprobs is None:
            state.prompt_logprobs = prompt_logprobs_output(request, self.tokenizer.decode)
        return state.prompt_logprobs

    def _check_stop_strings(self, state: OutputState, checked: int) -> None:
        """End the request at a stop string found in its new text (engine/output_state.py)."""
        request = state.request
        stop = cut_at_stop_string(state, checked)
        if stop is None:
            return
        if request.is_finished:  # max_tokens or eos on the same token: the stop string still wins
            request.status = RequestStatus.FINISHED_STOPPED
        else:
            self.scheduler.finish_requests(request.request_id, RequestStatus.FINISHED_STOPPED)
        request.stop_reason = stop

    def _finish(self, state: OutputState) -> None:
        request = state.request
        del self._states[request.request_id]
        group = self._groups[request.parent_id]
        group.remove(request.request_id)
        if not group:
            del self._groups[request.parent_id]
            self.num_requests_finished += 1
        now = time.monotonic()
        arrival = request.arrival_time
        ttft = (state.first_token - arrival) * 1000 if state.first_token else float("nan")
        choice = f" choice {request.index}" if request.index else ""
        logger.info("Reqid: %s,%s finished (%s): prompt %d tokens (%d cached), output %d tokens, %.1f ms "
                    "(first token %.1f ms), %d preemptions", request.request_id, choice, request.finish_reason,
                    request.num_prompt_tokens, request.num_cached_tokens, request.num_output_tokens,
                    (now - arrival) * 1000, ttft, request.num_preemptions)

    # ---- observability ----
    def get_stats(self) -> EngineStats:
        kv = self.kv_cache_manager
        sched = self.scheduler
        return EngineStats(
            num_running=sched.num_running,
            num_waiting=sched.num_waiting,
            num_free_blocks=kv.num_free_blocks,
            num_total_blocks=kv.num_blocks,
            kv_usage=kv.usage,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_preemptions=sched.num_preemptions,
            num_prompt_tokens_computed=sched.num_prompt_tokens_computed,
            num_generation_tokens=self.num_generation_tokens,
            num_requests_added=self.num_requests_added,
            num_requests_finished=self.num_requests_finished,
            num_failed_loads=sched.num_failed_loads,
        )

    def shutdown(self) -> None:
        if self.connector is not None:
            self.connector.shutdown()
        self.model_runner.shutdown()
