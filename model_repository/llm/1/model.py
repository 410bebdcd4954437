"""Triton glue for the `llm` model. All logic lives in backend/ (importable without Triton).

One thread, the responder, owns every response sender: it registers new requests, turns engine outputs into
responses, polls cancellation and publishes metrics. No other thread touches a sender, and nothing touches one
after its final response (tritonserver crashes in TRITONBACKEND_ResponseFactoryIsCancelled otherwise). Other
threads reach the responder only through its mailbox. execute() parses and submits; the engine runs on its
own thread (EngineLoop)."""

import json
import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field

import triton_python_backend_utils as pb_utils

from backend.config import EngineConfig
from backend.engine.engine_loop import EngineLoop
from backend.engine.sequence import RequestOutput
from backend.errors import InvalidRequest, NotFound, Overloaded
from backend.parent_death import watch_parent
from backend.triton_io import INPUT_NAMES, ResponseBuilder, parse_request
from backend.triton_metrics import EngineMetrics, LatencyTracker

log = logging.getLogger("tritonllm.model")

_POLL_INTERVAL_S = 0.5  # cancellation of requests and metrics
_FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def _guarded(work):
    try:
        work()
    except Exception:  # one request's trouble must not stop the responses of the others
        log.exception("responder work failed")


@dataclass
class _InFlight:
    """A request the responder still owes responses to."""

    sender: object  # pb_utils.InferenceResponseSender
    builder: ResponseBuilder
    latency: LatencyTracker = field(default_factory=LatencyTracker)


class TritonPythonModel:
    def initialize(self, args):
        # The stub ignores SIGTERM and would outlive a crashed tritonserver with the model in memory.
        watch_parent("tritonllm stub")
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        model_config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(model_config):
            raise pb_utils.TritonModelException("the llm model must use the decoupled transaction policy")
        parameters = {key: value["string_value"] for key, value in model_config.get("parameters", {}).items()}
        self.metrics = EngineMetrics(pb_utils, {"model": args["model_name"], "version": args["model_version"]})
        self.mailbox = queue.SimpleQueue()  # callables run on the responder thread; None stops it
        self.in_flight: dict[str, _InFlight] = {}  # owned by the responder thread
        self.engine = EngineLoop(EngineConfig.from_strings(parameters),
                                 on_output=lambda output: self.mailbox.put(lambda: self._on_output(output)))
        self.responder = threading.Thread(target=self._respond, name="tritonllm-responder", daemon=True)
        self.responder.start()

    def execute(self, requests):
        for request in requests:
            self._start(request)
        return None

    def _start(self, request):
        sender = request.get_response_sender()
        try:
            parsed = parse_request({name: self._input(request, name) for name in INPUT_NAMES})
        except InvalidRequest as exc:
            message = str(exc)  # `exc` is unbound once the except block ends
            self.mailbox.put(lambda: self._fail(sender, message, pb_utils.TritonError.INVALID_ARG))
            return
        request_id = uuid.uuid4().hex
        # Registered before the engine sees it: the mailbox is FIFO, so its outputs arrive after this.
        entry = _InFlight(sender, ResponseBuilder(parsed))
        self.mailbox.put(lambda: self.in_flight.__setitem__(request_id, entry))
        try:
            self.engine.submit(request_id, parsed.prompt, parsed.params)
        except Overloaded as exc:
            output = RequestOutput(request_id, [], 0, 0, True, error=exc)
            self.mailbox.put(lambda: self._on_output(output))

    @staticmethod
    def _input(request, name):
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        return None if tensor is None else tensor.as_numpy()

    # --- the responder thread ---------------------------------------------------------------------------------

    def _respond(self):
        next_poll = time.monotonic() + _POLL_INTERVAL_S
        while True:
            try:
                work = self.mailbox.get(timeout=max(0.0, next_poll - time.monotonic()))
                if work is None:
                    return
                _guarded(work)
            except queue.Empty:
                pass
            if time.monotonic() >= next_poll:
                _guarded(self._poll)
                next_poll = time.monotonic() + _POLL_INTERVAL_S

    def _on_output(self, output: RequestOutput):
        entry = self.in_flight.get(output.request_id)
        if entry is None:  # already finished here (cancelled, or a failed send)
            return
        if output.choices:
            entry.latency.on_output(self.metrics)
        if output.error is not None:
            code = (pb_utils.TritonError.INVALID_ARG if isinstance(output.error, InvalidRequest)
                    else pb_utils.TritonError.NOT_FOUND if isinstance(output.error, NotFound)
                    else pb_utils.TritonError.UNAVAILABLE if isinstance(output.error, Overloaded)
                    else pb_utils.TritonError.INTERNAL)
            self._finish(output.request_id, str(output.error), code)
            return
        if output.finished and any(c.finish_reason == "abort" for c in output.choices):
            self._finish(output.request_id, "[cancelled] the request was cancelled", pb_utils.TritonError.CANCELLED)
            return
        tensors = entry.builder.on_output(output)
        if tensors is None:
            return
        response = pb_utils.InferenceResponse(
            output_tensors=[pb_utils.Tensor(name, array) for name, array in tensors.items()])
        if output.finished:
            del self.in_flight[output.request_id]
        try:
            entry.sender.send(response, flags=_FINAL if output.finished else 0)
        except Exception as exc:
            log.warning("sending a response of request %s failed (%s); aborting it", output.request_id, exc)
            self.engine.abort(output.request_id)
            if not output.finished:
                self._finish(output.request_id, f"[internal] sending a response failed: {exc}",
                             pb_utils.TritonError.INTERNAL)

    def _finish(self, request_id: str, message: str, code):
        """End a request with an error response, its last."""
        self._fail(self.in_flight.pop(request_id).sender, message, code)

    @staticmethod
    def _fail(sender, message, code):
        try:
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code)), flags=_FINAL)
        except Exception:  # the client may be gone already
            log.debug("could not send an error response: %s", message)

    def _poll(self):
        """Requests waiting for admission produce no outputs, so cancellation is polled here, once per interval
        for every request in flight; a cancelled one is aborted and ended once."""
        for request_id, entry in list(self.in_flight.items()):
            if entry.sender.is_cancelled():
                log.info("request %s was cancelled by the client; aborting", request_id)
                self.engine.abort(request_id)
                self._finish(request_id, "[cancelled] the request was cancelled", pb_utils.TritonError.CANCELLED)
        self.metrics.update(self.engine.stats)

    def finalize(self):
        log.info("finalizing: finishing or aborting the requests in flight")
        self.engine.shutdown()
        self.mailbox.put(None)
        self.responder.join(timeout=10)
