"""Solution of exercise 02: locate and slot mapping."""


def locate(pos, page_size):
    return pos // page_size, pos % page_size


def locate_pow2(pos, page_size):
    if page_size <= 0 or page_size & (page_size - 1):
        raise ValueError(f"page_size={page_size} is not a power of two")
    shift = page_size.bit_length() - 1
    return pos >> shift, pos & (page_size - 1)


def slot_mapping(block_table, positions, page_size):
    slots = []
    for pos in positions:
        if pos == -1:
            slots.append(-1)  # padding stays padding; block_table[-1] would be the last page
            continue
        block, row = locate(pos, page_size)
        slots.append(block_table[block] * page_size + row)
    return slots
