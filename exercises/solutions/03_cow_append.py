"""Solution of exercise 03: append with copy-on-write."""


def append_slots(allocator, block_table, num_tokens, n, page_size):
    copies = []
    filled = num_tokens % page_size  # rows used in the last page (0: it is full, or there is none)
    if n > 0 and filled and allocator.refcount(block_table[-1]) > 1:
        shared = block_table[-1]
        private = allocator.allocate()
        copies.append((shared, private, filled))  # the caller copies these rows before writing
        allocator.decref(shared)
        block_table[-1] = private
    slots = []
    for pos in range(num_tokens, num_tokens + n):
        block, row = divmod(pos, page_size)
        if block == len(block_table):
            block_table.append(allocator.allocate())
        slots.append(block_table[block] * page_size + row)
    return slots, copies
