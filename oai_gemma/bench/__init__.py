"""`oai-gemma bench`: a load generator for OpenAI-compatible chat servers, in the style of `vllm bench serve`.

client.py sends the streamed requests and times every chunk, stats.py turns timings into percentiles,
report.py prints and writes them (table, JSON, markdown), plot.py draws the PNG, bare.py times the model
itself without a server, compare.py starts and stops the servers compared, command.py is the CLI.
"""
