"""The paged KV cache's bookkeeping: the page pool, the prefix cache over it, and each
request's block table. Plain Python (no tensors): the pages' memory is the model runner's.
"""
