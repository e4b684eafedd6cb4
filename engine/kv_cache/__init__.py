"""The paged KV cache's bookkeeping: the page pool, the prefix cache over it, and each
request's block table. Plain Python except the pool's K and V tensors, which the model runner
reads and writes. The scheduler drives all three; the block table knows a request only as a
`PageHolder` (its pages and slot), so this package sits below scheduling. A model whose
layers differ (sliding windows) has its layers in KV groups (`kv_groups`), each paged on its
own from the one pool (`group_pages`, `group_match`).
May import: engine.protocol.kv_events
"""
