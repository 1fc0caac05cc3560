"""uvicorn's Server, with SIGTERM as a drain that ends the process with status 0."""
from __future__ import annotations

import signal

import uvicorn


class DrainingServer(uvicorn.Server):
    """On SIGTERM: the app answers 503 to requests still arriving (``serving.draining``),
    uvicorn stops listening, waits for the answers in flight (its
    ``timeout_graceful_shutdown``) and runs the app's shutdown (the engine's
    drain). uvicorn re-raises a signal it caught once it has shut down; SIGTERM
    is not recorded, so the process exits 0. SIGINT keeps uvicorn's behaviour."""

    def __init__(self, config: uvicorn.Config, serving):
        super().__init__(config)
        self.serving = serving

    def handle_exit(self, sig, frame) -> None:
        self.serving.draining = True
        if sig == signal.SIGTERM:
            self.should_exit = True
            return
        super().handle_exit(sig, frame)
