"""Triton glue for the `llm` model: execute() hands each request to the engine and returns at once; a sender
thread turns engine outputs into responses. All logic lives in backend/ (importable without Triton)."""

import json
import logging
import os
import queue
import threading
import uuid

import triton_python_backend_utils as pb_utils

from backend.config import EngineConfig
from backend.engine.engine_loop import EngineLoop
from backend.errors import InvalidRequest, NotFound, Overloaded
from backend.triton_io import INPUT_NAMES, ResponseBuilder, parse_request
from backend.triton_metrics import EngineMetrics, LatencyTracker

log = logging.getLogger("tritonllm.model")

_POLL_INTERVAL_S = 0.5  # cancellation of waiting requests, metrics
_FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class TritonPythonModel:
    def initialize(self, args):
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        model_config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(model_config):
            raise pb_utils.TritonModelException("the llm model must use the decoupled transaction policy")
        parameters = {key: value["string_value"] for key, value in model_config.get("parameters", {}).items()}
        self.engine = EngineLoop(EngineConfig.from_strings(parameters))
        self.server_pid = os.getppid()
        self.metrics = EngineMetrics(pb_utils, {"model": args["model_name"], "version": args["model_version"]})
        self.in_flight = {}  # request id → (response_sender, ResponseBuilder, LatencyTracker)
        self.lock = threading.Lock()
        self.outbox = queue.SimpleQueue()  # (request id, RequestOutput); None stops the sender thread
        self.stopping = threading.Event()
        self.sender = threading.Thread(target=self._send_loop, name="tritonllm-sender", daemon=True)
        self.poller = threading.Thread(target=self._poll, name="tritonllm-poll", daemon=True)
        self.sender.start()
        self.poller.start()

    def execute(self, requests):
        for request in requests:
            self._start(request)
        return None

    def _start(self, request):
        sender = request.get_response_sender()
        try:
            parsed = parse_request({name: self._input(request, name) for name in INPUT_NAMES})
        except InvalidRequest as exc:
            self._fail(sender, str(exc), pb_utils.TritonError.INVALID_ARG)
            return
        request_id = uuid.uuid4().hex
        with self.lock:
            self.in_flight[request_id] = (sender, ResponseBuilder(parsed), LatencyTracker())
        try:
            self.engine.submit(request_id, parsed.prompt, parsed.params,
                               lambda output: self.outbox.put((request_id, output)))
        except Overloaded as exc:
            with self.lock:
                del self.in_flight[request_id]
            self._fail(sender, str(exc), pb_utils.TritonError.UNAVAILABLE)

    @staticmethod
    def _input(request, name):
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        return None if tensor is None else tensor.as_numpy()

    @staticmethod
    def _fail(sender, message, code):
        try:
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code)), flags=_FINAL)
        except Exception:  # the client may be gone already
            log.debug("could not send an error response: %s", message)

    def _send_loop(self):
        while True:
            item = self.outbox.get()
            if item is None:
                return
            request_id, output = item
            with self.lock:
                entry = self.in_flight.pop(request_id, None) if output.finished else self.in_flight.get(request_id)
            if entry is None:
                continue
            sender, builder, latency = entry
            if output.choices:
                latency.on_output(self.metrics)
            if output.error is not None:
                code = (pb_utils.TritonError.INVALID_ARG if isinstance(output.error, InvalidRequest)
                        else pb_utils.TritonError.NOT_FOUND if isinstance(output.error, NotFound)
                        else pb_utils.TritonError.INTERNAL)
                self._fail(sender, str(output.error), code)
            elif output.finished and any(c.finish_reason == "abort" for c in output.choices):
                self._fail(sender, "[cancelled] the request was cancelled", pb_utils.TritonError.CANCELLED)
            elif not output.finished and self._cancel_if_requested(request_id, sender):
                continue
            else:
                tensors = builder.on_output(output)
                if tensors is not None:
                    response = pb_utils.InferenceResponse(
                        output_tensors=[pb_utils.Tensor(name, array) for name, array in tensors.items()])
                    try:
                        sender.send(response, flags=_FINAL if output.finished else 0)
                    except Exception:
                        log.warning("sending to request %s failed; aborting it", request_id)
                        self.engine.abort(request_id)

    def _cancel_if_requested(self, request_id, sender) -> bool:
        if not sender.is_cancelled():
            return False
        log.info("request %s was cancelled by the client; aborting", request_id)
        self.engine.abort(request_id)
        return True

    def _poll(self):
        """Requests that wait for admission produce no outputs, so their cancellation is polled; metrics too."""
        while not self.stopping.wait(_POLL_INTERVAL_S):
            if os.getppid() != self.server_pid:  # tritonserver was killed: never outlive it
                log.error("tritonserver (pid %d) is gone; exiting", self.server_pid)
                os._exit(1)
            with self.lock:
                entries = list(self.in_flight.items())
            for request_id, (sender, _, _) in entries:
                self._cancel_if_requested(request_id, sender)
            self.metrics.update(self.engine.stats())

    def finalize(self):
        log.info("finalizing: finishing or aborting the requests in flight")
        self.engine.shutdown()
        self.stopping.set()
        self.outbox.put(None)
        self.sender.join(timeout=10)
        self.poller.join(timeout=5)
