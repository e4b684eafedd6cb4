"""OpenAI's HTTP API (`--openai-port`), served by uvicorn in the gRPC server's event loop over
the same admission path: each request becomes sluice.v1 GenerateRequests for
GenerationServicer.submit, and its events become OpenAI's answer.

`server` (uvicorn in the loop, start and drain), `app` (the routes), `gate` (bearer token and
body size, before any parsing), `schemas` (the request bodies), `translate` (the fields both
endpoints share, into sluice.v1), `completions` and `chat` (each endpoint's request and answer),
`choices` (the choices' state from events), `logprobs` (OpenAI's two logprob shapes), `fanout`
(several prompts' requests as one stream), `respond` and `sse` (whole or streamed answers),
`tokenize` (vLLM's /tokenize and /detokenize), `errors` (OpenAI's error JSON and statuses).
May import: service.rpc, service.text, service.engine_link, service.ops, service.config, engine.protocol, sluice.v1
"""
