"""A reference model of the allocators from plain Python lists and sets.

It mirrors SGLang's free-list order (docs/memory-semantics.md §2.3-2.6) so tests compare returned
slots exactly, not only counts.
"""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class RefFreeList:
    def __init__(self, num_pages: int, page_size: int, need_sort: bool) -> None:
        self.page_size = page_size
        self.need_sort = need_sort
        self.free = list(range(1, num_pages + 1))
        self.release: list[int] = []
        self.group: list[int] | None = None
        self.segment_group: list[int] = []  # pages of segment frees inside a group, call order

    def available(self) -> int:
        return (len(self.free) + len(self.release)) * self.page_size

    def merge(self) -> None:
        self.free = sorted(self.free + self.release)
        self.release = []

    def take(self, num_pages: int) -> list[int] | None:
        if self.need_sort and num_pages > len(self.free):
            self.merge()
        if num_pages > len(self.free):
            return None
        pages, self.free = self.free[:num_pages], self.free[num_pages:]
        return pages

    def expand(self, pages: list[int]) -> list[int]:
        return [p * self.page_size + o for p in pages for o in range(self.page_size)]

    def release_slots(self, slots: list[int]) -> None:
        if not slots:
            return
        if self.group is not None:
            self.group.extend(slots)
            return
        self._return(slots)

    def _return(self, slots: list[int]) -> None:
        ps = self.page_size
        self._give(slots if ps == 1 else sorted({s // ps for s in slots}))

    def _give(self, pages: list[int]) -> None:
        """To the release list with need_sort, else the free list: appended at page size 1, in front
        when paged (SGLang's paged allocator prepends to either)."""
        if self.page_size == 1:
            if self.need_sort:
                self.release += pages
            else:
                self.free += pages
        elif self.need_sort:
            self.release = pages + self.release
        else:
            self.free = pages + self.free

    def release_segment_pages(self, slots: list[int]) -> None:
        """free_segment: one page per page start, in position order, no sorting."""
        ps = self.page_size
        pages = [s // ps for i, s in enumerate(slots) if i == 0 or s % ps == 0]
        if self.group is not None:
            self.segment_group.extend(pages)
        else:
            self._give(pages)

    def group_end(self) -> None:
        """SGLang's paged free_group_end: the group's free() pages, sorted and unique, go in
        front; then its segment pages, unsorted in call order, in front of those."""
        group, self.group = self.group, None
        segments, self.segment_group = self.segment_group, []
        if group:
            self._return(group)
        if segments:
            self._give(segments)


def ref_extend(
    free_list: RefFreeList,
    prefix_lens: list[int],
    seq_lens: list[int],
    last_locs: list[int],
    pages: list[int],
) -> list[int]:
    """Slots by the paged rules: finish the partial page from last_loc+1, then fresh pages."""
    ps = free_list.page_size
    out: list[int] = []
    cursor = 0
    for p, s, last in zip(prefix_lens, seq_lens, last_locs, strict=True):
        num_new = cdiv(s, ps) - cdiv(p, ps)
        mine = pages[cursor : cursor + num_new]
        cursor += num_new
        for pos in range(p, s):
            if pos < cdiv(p, ps) * ps:
                out.append(last + 1 + pos - p)
            else:
                out.append(mine[pos // ps - cdiv(p, ps)] * ps + pos % ps)
    return out
