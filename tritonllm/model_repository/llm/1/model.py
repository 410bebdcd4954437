"""Triton glue for the `llm` model. All logic lives in tritonllm/engine/ (importable without Triton); this file runs
the engine's parts on three threads:

- Triton's thread (execute): parses the tensors and processes the prompt (tokenizer, chat template, checks),
  then submits token ids to the core;
- the core thread (CoreLoop): schedules, runs the model and samples;
- the responder: turns the core's token ids into text (OutputProcessor), and text into responses.

The responder owns every response sender: it registers new requests, sends, polls cancellation and publishes
metrics. No other thread touches a sender, and nothing touches one after its final response (tritonserver
crashes in TRITONBACKEND_ResponseFactoryIsCancelled otherwise). Other threads reach it through its mailbox."""

import dataclasses
import gc
import json
import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass

import triton_python_backend_utils as pb_utils

from tritonllm.engine.config import EngineConfig
from tritonllm.engine.core.core_loop import CoreLoop
from tritonllm.engine.core.sequence import CoreOutput
from tritonllm.interface.errors import Cancelled, RequestError, error_kind_of
from tritonllm.interface.tensors import INPUTS, FinishReason
from tritonllm.engine.llm_engine import EngineParts
from tritonllm.parent_death import watch_parent
from tritonllm.engine.processing.outputs import RequestOutput
from tritonllm.engine.triton_io import (ResponseBuilder, cancel_target, cancel_tensors, instance_tensors,
                                        parse_request, tokenized_tensors)
from tritonllm.engine.triton_metrics import EngineMetrics, RequestTracker

log = logging.getLogger("tritonllm.model")

_POLL_INTERVAL_S = 0.5  # cancellation of requests and metrics
_RESPONDER_STOP_TIMEOUT_S = 10.0
_CANCELLED = "the request was cancelled"
_SHUT_DOWN = "the server is shutting down: the request was cancelled"
_FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def _response(tensors: dict) -> "pb_utils.InferenceResponse":
    return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(name, array) for name, array in tensors.items()])


def _triton_error(error: Exception) -> "pb_utils.TritonError":
    return pb_utils.TritonError(str(error), getattr(pb_utils.TritonError, error_kind_of(error).wire.triton_code))


@dataclass
class _InFlight:
    """A request the responder still owes responses to."""

    sender: object  # pb_utils.InferenceResponseSender
    builder: ResponseBuilder
    tracker: RequestTracker
    triton_id: str  # the client's id for it (Triton's request id), which a cancel request names


class TritonPythonModel:
    def initialize(self, args):
        # The stub ignores SIGTERM and would outlive a crashed tritonserver with the model in memory.
        self.watchdog = watch_parent()
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        model_config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(model_config):
            raise pb_utils.TritonModelException("the llm model must use the decoupled transaction policy")
        parameters = {key: value["string_value"] for key, value in model_config.get("parameters", {}).items()}
        config = EngineConfig.from_strings(parameters)
        if args["model_instance_kind"] == "GPU":  # instance_group KIND_GPU: Triton chose this engine's GPU
            config = dataclasses.replace(config, device=f"cuda:{args['model_instance_device_id']}")
        log.info("engine instance %s starting on %s", args["model_instance_name"], config.device)
        self.mailbox = queue.SimpleQueue()  # callables run on the responder thread; None stops it
        self.in_flight: dict[str, _InFlight] = {}  # owned by the responder thread
        self.abort_message = _CANCELLED  # what an aborted request is told; the responder's
        self.core = CoreLoop(on_outputs=lambda outputs: self.mailbox.put(lambda: self._on_core_outputs(outputs)))
        self.parts = EngineParts.create(config, start_core=self.core.start)  # the core is built on its own thread
        self.inputs = self.parts.inputs  # used on Triton's thread only
        self.stream_interval = config.stream_interval
        self.instance = args["model_instance_name"]
        self.outputs = self.parts.outputs  # used on the responder thread only
        # Each instance is its own engine: its metrics carry its instance name (e.g. llm_0_1). Made only once the
        # engine is built: a failed load gets no finalize(), and a metric the stub frees itself segfaults it (below).
        self.metrics = EngineMetrics(pb_utils, {"model": args["model_name"], "version": args["model_version"],
                                                "instance": args["model_instance_name"]})
        self.responder = threading.Thread(target=self._respond, name="tritonllm-responder", daemon=True)
        self.responder.start()

    # --- Triton's thread ----------------------------------------------------------------------------------------

    def execute(self, requests):
        for request in requests:
            self._start(request)
        return None

    def _start(self, request):
        arrived = time.monotonic()
        sender = request.get_response_sender()
        request_id = uuid.uuid4().hex
        try:
            inputs = {name: self._input(request, name) for name in INPUTS}
            if (target := cancel_target(inputs)) is not None:
                self.mailbox.put(lambda: self._cancel(target, sender))
                return
            parsed = parse_request(inputs)
            if parsed.tokenize_only:  # answered at once: nothing reaches the core
                tokenized = self.inputs.tokenize(parsed.prompt, parsed.options, parsed.params.lora_path)
                tensors = tokenized_tensors(tokenized, self.inputs.limits.capacity)
                self.mailbox.put(lambda: self._send_final(sender, tensors))
                return
            core_request = self.inputs.process(request_id, parsed.prompt, parsed.params, parsed.options)
        except Exception as exc:
            if not isinstance(exc, RequestError):
                log.exception("request %s could not be processed", request_id)
            error = _triton_error(exc)
            self.mailbox.put(lambda: self._send_final_error(sender, error))
            return
        # Registered before the core sees it: the mailbox is FIFO, so its outputs arrive after this.
        entry = _InFlight(sender, ResponseBuilder(parsed, self.stream_interval), RequestTracker(
            arrived, len(core_request.prompt_token_ids), core_request.params.num_sequences), request.request_id())
        self.mailbox.put(lambda: self._register(request_id, entry, core_request))
        try:
            self.core.submit(core_request)
        except RequestError as exc:  # Overloaded
            output = RequestOutput(request_id, [], 0, 0, True, error=exc)
            self.mailbox.put(lambda: self._respond_to(output))

    @staticmethod
    def _input(request, name):
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        return None if tensor is None else tensor.as_numpy()

    # --- the responder thread -----------------------------------------------------------------------------------

    def _respond(self):
        next_poll = time.monotonic() + _POLL_INTERVAL_S
        while True:
            try:
                work = self.mailbox.get(timeout=max(0.0, next_poll - time.monotonic()))
                if work is None:
                    return
                self._guarded(work)
            except queue.Empty:
                pass
            if time.monotonic() >= next_poll:
                self._guarded(self._poll)
                next_poll = time.monotonic() + _POLL_INTERVAL_S

    def _guarded(self, work):
        try:
            work()
        except Exception as error:  # one request's trouble must not stop the responses of the others
            self.metrics.internal_errors.report("responder", error)

    def _register(self, request_id: str, entry: _InFlight, core_request):
        self.in_flight[request_id] = entry
        self.outputs.add_request(request_id, core_request.prompt_token_ids, core_request.params,
                                 entry.builder.request.options.tools, core_request.reasoning_start)
        if "model_instance" in entry.builder.request.returns:
            try:
                entry.sender.send(_response(instance_tensors(self.instance)))
            except Exception:  # the client may be gone already: the poll finds it cancelled
                log.debug("could not send request %s's first response", request_id)

    def _on_core_outputs(self, outputs: list[CoreOutput]):
        for core_output in outputs:
            output, stop = self.outputs.process(core_output)
            if stop:  # stop strings ended these choices: the core still runs them
                self.core.abort(core_output.request_id, stop)
            if output is not None:
                self._guarded(lambda: self._respond_to(output))

    def _respond_to(self, output: RequestOutput):
        entry = self.in_flight.get(output.request_id)
        if entry is None:  # already finished here (cancelled, or a failed send)
            return
        entry.tracker.on_output(output, self.metrics)
        if output.error is not None:
            self._finish(output.request_id, output.error)
            return
        if output.finished and any(c.finish_reason == FinishReason.ABORT for c in output.choices):
            self._finish(output.request_id, Cancelled(self.abort_message))
            return
        tensors = entry.builder.on_output(output)
        if tensors is None:
            return
        response = _response(tensors)
        if output.finished:
            del self.in_flight[output.request_id]
            entry.tracker.on_finished(self.metrics)
        try:
            entry.sender.send(response, flags=_FINAL if output.finished else 0)
        except Exception as exc:
            log.warning("sending a response of request %s failed (%s); aborting it", output.request_id, exc)
            self.core.abort(output.request_id)
            self.outputs.abort(output.request_id)
            if not output.finished:
                self._finish(output.request_id, RuntimeError(f"sending a response failed: {exc}"))

    def _cancel(self, triton_id: str, sender):
        """A cancel request: end the requests in flight with that Triton request id, then answer whether any was."""
        cancelled = [request_id for request_id, entry in self.in_flight.items() if entry.triton_id == triton_id]
        for request_id in cancelled:
            self.core.abort(request_id)
            self._finish(request_id, Cancelled(_CANCELLED))
        self._send_final(sender, cancel_tensors(bool(cancelled)))

    def _finish(self, request_id: str, error: Exception):
        """End a request with an error response, its last."""
        self.outputs.abort(request_id)
        entry = self.in_flight.pop(request_id)
        entry.tracker.on_failed(self.metrics, error)
        self._send_final_error(entry.sender, _triton_error(error))

    @staticmethod
    def _send_final(sender, tensors: dict):
        try:
            sender.send(_response(tensors), flags=_FINAL)
        except Exception:  # the client may be gone already
            log.debug("could not send a final response")

    @staticmethod
    def _send_final_error(sender, error):
        try:
            sender.send(pb_utils.InferenceResponse(error=error), flags=_FINAL)
        except Exception:  # the client may be gone already
            log.debug("could not send an error response: %s", error.message())

    def _poll(self):
        """Requests waiting for admission produce no outputs, so cancellation is polled here, once per interval
        for every request in flight; a cancelled one is aborted and ended once."""
        for request_id, entry in list(self.in_flight.items()):
            if entry.sender.is_cancelled():
                log.info("request %s was cancelled by the client; aborting", request_id)
                self.core.abort(request_id)
                self._finish(request_id, Cancelled(_CANCELLED))
        self.metrics.update(self.core.stats)

    def _on_shutdown(self):
        self.abort_message = _SHUT_DOWN

    def finalize(self):
        """Triton calls this once it sends no more requests, and the stub tears itself down right after: every
        request gets its final response and our threads stop before this returns; then the Triton objects we hold
        are released while the stub can still take them back."""
        log.info("finalizing: finishing or aborting the requests in flight")
        self.mailbox.put(self._on_shutdown)
        self.core.shutdown()  # the requests that do not finish in time are aborted: their outputs reach the mailbox
        self.parts.grammars.shutdown()
        self.mailbox.put(None)
        self.responder.join(timeout=_RESPONDER_STOP_TIMEOUT_S)
        if self.responder.is_alive():  # stuck in a send: its senders and metrics stay its own
            log.error("the responder did not stop within %.0f s; finalizing without it", _RESPONDER_STOP_TIMEOUT_S)
            return
        # The responder is gone, so this thread owns the senders now: a request the core never answered (its
        # thread stuck in a step) still gets its final response.
        for request_id in list(self.in_flight):
            self._finish(request_id, Cancelled(_SHUT_DOWN))
        # The 24.10 stub frees what the model still holds only after its own state, and a custom metric freed then
        # segfaults it (Metric::Clear on a null shared-memory pool; fixed upstream in python_backend PR #429).
        self.metrics = None
        gc.collect()
        log.info("finalized: every request answered, threads stopped, metrics released")
