"""OpenAI-compatible HTTP server over the real engine (experiments.api_server): protocol (request / response
bodies), bridge (the engine loop on its own thread, asyncio queues per request), metrics (Prometheus), app
(FastAPI endpoints), server (start-up, serving, SIGTERM shutdown writing the run's result files)."""
