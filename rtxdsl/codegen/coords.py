"""The writer of row and pointwise kernels: values evaluated at index expressions.

Every domain dim has its own index (``i0, i1, ...`` in pointwise kernels, ``r*``/``c*`` for the
rows and reduced columns of row kernels), every value is asked for *at coordinates*
(:class:`~rtxdsl.registry.Coords`: an index expression per dim of the value plus the predicates
a load there must satisfy), and a movement op answers by asking its operands at remapped
coordinates (its ``remap``). A value is computed once per (coordinates, scope); loads are masked
with the kernel's mask and the coordinates' predicates, so nothing is read out of bounds.

A flat kernel (no movement op) is the case where the domain's dims are the coalesced ones every
operand walks together (``lower.schedule.flat_walk``) and every value is read at the kernel's
own indices. A value that is one per row (a per-row load, a per-row node at its own coordinates)
is computed once, before any loop over columns.
"""

from __future__ import annotations

import torch

from ..dtypes import TRITON_TYPE, accumulator, compute_dtype
from ..lower.params import (
    FLAG_PTR,
    input_ptr,
    output_name,
    output_ptr,
    own_params,
)
from ..lower.passes import reduce_dtype, remaps
from ..lower.roles import Role
from ..lower.spec import BCAST, NodeSpec, Src
from ..ops import REGISTRY, Coords, DtypeRule, OpKind, RemapCtx
from ..ops.llm import picked_by_position
from .dot import k_loop
from .source import Scope, Writer, offset_terms


class CoordWriter(Writer):
    """The writer for row and pointwise KernelSpecs, flat or not (see the module docstring)."""

    # ---- parameters -------------------------------------------------------------------
    def build_params(self) -> None:
        s = self.spec
        assert s.domain is not None
        self.params += [p.name for p in own_params(s)]
        self.nr = sum(1 for red in s.domain if not red)
        self.nc = len(s.domain) - self.nr
        self.flag_slot = {i: k for k, i in enumerate(s.flags)}

    # ---- coordinates ------------------------------------------------------------------
    def _domain(self, full: bool) -> tuple[str, ...]:
        """The domain's index per dim: reduced dims are "0" for per-row values."""
        assert self.spec.domain is not None
        rows = iter(self.ridx)
        cols = iter(self.cidx if full and self.row else ())
        return tuple((next(cols) if full else "0") if red else next(rows) for red in self.spec.domain)

    def _ones(self, ref: tuple) -> tuple[bool, ...]:
        kind, i = ref
        if kind is Src.LOAD:
            return tuple(c == BCAST for c in self.spec.loads[i].rows)
        return self.spec.nodes[i].ones if kind is Src.NODE else ()  # a slot is a scalar

    @staticmethod
    def _adjust(c: Coords, ones: tuple[bool, ...]) -> Coords:
        """Coordinates of a value broadcast against ``c``: trailing dims, 0 where it has size 1."""
        idx = c.idx[len(c.idx) - len(ones) :] if ones else ()
        return Coords(tuple("0" if one else i for i, one in zip(idx, ones)), c.pred)

    def _default(self, i: int) -> Coords:
        """A node's own coordinates: the domain's (a per-row value's reduced dims at 0), or the
        rows' for a per-row value without the reduced dims (a coordinate kernel's dropped ones)."""
        node = self.spec.nodes[i]
        assert self.spec.domain is not None
        if node.role is Role.DROP and len(node.ones) < len(self.spec.domain):
            return self._adjust(Coords(tuple(self.ridx)), node.ones)
        return self._adjust(Coords(self._domain(node.role is Role.FULL)), node.ones)

    def _in_place(self, node: NodeSpec) -> bool:
        """A view (``unsqueeze``) whose operand already has its rank (a flat kernel's values all
        have the domain's): it reads the operand where it is."""
        return REGISTRY[node.op].view and all(
            len(self._ones(r)) == len(node.ones) for r in node.srcs if r[0] in (Src.LOAD, Src.NODE)
        )

    def _per_row(self, ref: tuple, c: Coords) -> bool:
        """Is ``ref`` at ``c`` one value per row (a per-row load, or a per-row node at its own
        coordinates)?"""
        kind, i = ref
        if kind is Src.LOAD:
            return self.spec.loads[i].role is not Role.FULL
        return self.spec.nodes[i].role in (Role.KEEP, Role.DROP) and c == self._default(i)

    def _per_column(self, j: int, c: Coords) -> bool:
        """Is load ``j`` at ``c`` one value per column of a row kernel with column reductions (a
        norm's weight in its backward), whose programs loop over rows: loaded before that loop?"""
        assert self.spec.domain is not None
        classes = list(zip(self.spec.loads[j].rows, self.spec.domain))
        rows, cols = [cls for cls, red in classes if not red], [cls for cls, red in classes if red]
        along = any(cls != BCAST for cls in cols)  # (a 0-dim value: one element, loaded where read)
        return bool(self.spec.columns) and self.nc == 1 and self._plain(c) and along and all(r == BCAST for r in rows)

    def _plain(self, c: Coords) -> bool:
        """Coordinates that are the kernel's own indices (no remapped index, no predicate)."""
        own = {*self.ridx, *self.cidx}
        return not c.pred and all(i == "0" or i in own for i in c.idx)

    def _zero(self, full: bool) -> str:
        """0 with the shape of the kernel's index tile (for values made of indices only)."""
        if not self.row:
            return "offs * 0"
        return "(rows * 0 + cols * 0)" if full else "rows * 0"

    def _mask(self, full: bool, c: Coords) -> str:
        base = "mask" if full or not self.row else "row_mask"
        return " & ".join([base, *(f"({p})" for p in c.pred)])

    # ---- values -----------------------------------------------------------------------
    def value(self, ref: tuple, loop: Scope) -> str:
        kind, i = ref
        if kind is Src.SLOT:
            return f"s{i}"
        if kind is Src.LOAD:  # a reduction's operand read directly: at the domain's full coordinates
            return self._value_at(ref, self._adjust(Coords(self._domain(True)), self._ones(ref)), loop, True)
        node = self.spec.nodes[i]
        if node.role is Role.SCALAR or REGISTRY[node.op].kind is OpKind.REDUCTION:
            return super().value(ref, loop)
        full = node.role is Role.FULL
        return self._value_at(ref, self._default(i), loop if full else self.top, full)

    def _value_at(self, ref: tuple, c: Coords, scope: Scope, full: bool) -> str:
        kind, i = ref
        if kind is Src.SLOT:
            return f"s{i}"
        if kind is Src.NODE:
            node = self.spec.nodes[i]
            if node.role is Role.SCALAR or REGISTRY[node.op].kind is OpKind.REDUCTION:
                return self.value(ref, scope)  # one value per row: the same at every column
        if self._per_row(ref, c):  # computed (or loaded) once per row, before any loop over columns
            scope, full = self.top, False
        elif kind is Src.LOAD and self._per_column(i, c):  # once per program, before its loop over rows
            scope = self.before
        # a value made for the whole tile is not a per-row value (its shape is the tile's); a
        # per-row value serves the tile too (it broadcasts)
        keys = [(ref, c, False), (ref, c, True)] if full else [(ref, c, False)]
        for s in (scope, self.top):
            for key in keys:
                if key in s.memo:
                    return s.memo[key]
        if kind is Src.LOAD:
            name = self._load_at(i, c, scope, full)
        else:
            node = self.spec.nodes[i]
            placed = node.role is not Role.FULL or bool(self.cidx) or not self.row  # its default coordinates exist
            own = (Src.NODE, i) not in self.named and placed and c == self._default(i)
            name = f"v{i}" if own else f"v{i}_{next(self.tmp_ids)}"
            self.named.add((Src.NODE, i))
            if REGISTRY[node.op].kind is OpKind.MOVEMENT and not self._in_place(node):
                self._remap(i, name, c, scope, full)
            elif REGISTRY[node.op].kind is OpKind.CONTRACTION:
                assert c == self._default(i), "a product is computed at its own tile only"
                self._product(i, name, c, scope)
            else:

                def operand(r: tuple) -> str:
                    return self._value_at(r, self._adjust(c, self._ones(r)), scope, full)

                self._reductions_first(node, operand)
                if not (c == self._default(i) and self._shared_exp(node, name, scope, operand)):
                    self._emit_with(node, name, scope, [operand(r) for r in node.srcs])
            if i in self.rounded:
                name = self.round_stored(name, i, scope)
        scope.memo[(ref, c, full)] = name
        return name

    def _ready(self, ref: tuple) -> bool:
        """Can ``ref`` be computed at the top now (no reduction of a pass still open under it)?"""
        if ref[0] is not Src.NODE:
            return True
        node = self.spec.nodes[ref[1]]
        if REGISTRY[node.op].kind is OpKind.REDUCTION:
            return not self.spec.looped or ref in self.top.memo
        return node.role is not Role.FULL and all(self._ready(r) for r in node.srcs)

    def _direct(self, i: int) -> str | None:
        """``sum(where(positions == t, x, c))`` over a row's one reduced dim, ``x`` loaded (a
        cross-entropy's target logit): ``x`` read at ``t`` once per row (where ``t`` is in range)
        plus ``c`` times the row's other lanes (exactly the masked sum's terms), instead of a select
        and an add per element and a block reduction."""
        node = self.spec.nodes[i]
        found = picked_by_position(node, self._node_at) if self.row and not self.spec.split and self.nc == 1 else None
        if found is None:
            return None
        x, t, c = found
        if (
            x[0] is not Src.LOAD
            or self.spec.loads[x[1]].role is not Role.FULL
            or not (self._ready(t) and self._ready(c))
        ):
            return None

        def per_row(ref: tuple) -> str:
            return self._value_at(ref, self._adjust(Coords(self._domain(False)), self._ones(ref)), self.top, False)

        tv = per_row(t)
        if self.types[tv].is_floating_point or self.types[tv] is torch.bool:
            return None
        rdt = reduce_dtype(node)
        inside = self.tmp(self.top, f"({tv} >= 0) & ({tv} < n_cols)")
        at = Coords(tuple(tv if red else r for r, red in zip(self._domain(False), self.spec.domain)), (inside,))
        xv = self.cast(self._value_at(x, at, self.top, False), rdt)
        cv = self.cast(per_row(c), rdt)
        # the row's other lanes, each adding c (none: nothing, if c is NaN too); n_cols + zeros, not
        # n_cols.to(...): a size argument equal to 1 is a constexpr on the GPU
        tt = TRITON_TYPE[rdt]
        others = self.tmp(self.top, f"n_cols + tl.zeros([1, 1], dtype={tt}) - {inside}.to({tt})")
        name = f"v{i}"
        self.top.add(f"{name} = tl.where({inside}, {xv}, 0.0) + tl.where({others} > 0, {others} * {cv}, 0.0)")
        self.types[name] = rdt
        return name

    def _load_at(self, j: int, c: Coords, scope: Scope, full: bool) -> str:
        ld = self.spec.loads[j]
        terms = offset_terms(self.load_names[j], ld.rows, c.idx)
        ptr = input_ptr(ld.input)
        if self._plain(c) and not terms and not (full and self.row) and not remaps(self.spec):
            # one element, the same everywhere (where no index arithmetic needs it as a tile)
            text = f"tl.load({ptr})"
        else:
            # the kernel's own indices broadcast against the mask; remapped ones (and an offset of no
            # index at all) get the mask's tile shape, even where every index is a scalar
            pad = [] if terms and self._plain(c) else [self._zero(full)]
            mask = "col_mask" if scope is self.before else self._mask(full, c)  # (no rows there)
            text = f"tl.load({ptr} + {' + '.join([*terms, *pad])}, mask={mask}, other=0)"
        dtype = self.spec.in_dtypes[ld.input]
        cdt = compute_dtype(dtype)
        name = f"x{j}_{next(self.tmp_ids)}"
        if cdt != dtype:
            text += f".to({TRITON_TYPE[cdt]})"
        elif dtype is not torch.bool:  # (a bool tensor's pointer type is the launcher's to choose)
            self.known[name] = TRITON_TYPE[dtype]
        scope.add(f"{name} = {text}")
        self.types[name] = cdt
        return name

    def _remap(self, i: int, name: str, c: Coords, scope: Scope, full: bool) -> None:
        node = self.spec.nodes[i]
        op = REGISTRY[node.op]

        def value(k: int, at: Coords) -> str:
            r = node.srcs[k]
            v = self._value_at(r, self._adjust(at, self._ones(r)), scope, full)
            if op.rule is DtypeRule.PROMOTE or (op.rule is DtypeRule.KEEP and k == 0):
                return self.cast(v, node.cdt)
            return v

        def flag(bad: str) -> None:
            where = self._mask(full, c)
            scope.add(f"tl.store({FLAG_PTR} + {self.flag_slot[i]} + {self._zero(full)}, 1, mask={where} & ({bad}))")

        zero = self._zero(full)
        # index arithmetic on tiles only (the interpreter rejects masks made from scalars)
        out = Coords(tuple(zero if i == "0" else i for i in c.idx), c.pred)
        ctx = RemapCtx(
            out=out,
            attrs=dict(node.attrs),
            args=tuple(f"m{i}_{k}" for k in range(node.nargs)),
            src_ranks=tuple(len(self._ones(r)) for r in node.srcs),
            value=value,
            tmp=lambda e: self.tmp(scope, e),
            flag=flag,
            zero=zero,
        )
        expr = op.remap(ctx)  # type: ignore[misc]
        # positions at remapped coordinates are whatever index remapped them (a target): int64
        result = self.result_dtype(node) if self._plain(c) else compute_dtype(node.dtype)
        expr = f"({expr}) != 0" if result is torch.bool else f"({expr}).to({TRITON_TYPE[result]})"
        scope.add(f"{name} = {expr}")
        self.types[name] = result

    def _product(self, i: int, name: str, c: Coords, scope: Scope) -> None:
        """A contraction's ``[ROWS, BLOCK_SIZE]`` tile at the row block and column block ``c``: Triton
        tutorial 03's K loop over ``BLOCK_K`` slices into an fp32 accumulator (the row kernel's
        values then read it as they would read a loaded tile). The left operand is read at the
        tile's rows (its batch dims at the rows' batch coordinates), the right one (no batch dims)
        at the tile's columns."""
        node, tile = self.spec.nodes[i], self.spec.gemm
        assert tile is not None
        (_, ja), (_, jb) = node.srcs
        attrs = dict(node.attrs)
        size = f"m{i}_0"  # the contracted extent
        a_idx = [*c.idx[:-1], "ks[None, :]"]  # A's (..., m, k) at the tile's rows
        a_idx[-2:] = a_idx[-2:][::-1] if attrs["ta"] else a_idx[-2:]
        b_idx = ["ks[:, None]", c.idx[-1]][:: -1 if attrs["tb"] else 1]
        b_idx[:0] = self.rbatch  # its batch dims at the program's batch (its rows keep to one)
        operand = node.cdt  # the dtype the product's operands multiply in (an fp32 buffer is cast as loaded)
        left = (f"{input_ptr(ja)} + {self._operand_offset(ja, a_idx)}", f"row_mask & (ks[None, :] < {size})")
        right = (f"{input_ptr(jb)} + {self._operand_offset(jb, b_idx)}", f"(ks[:, None] < {size}) & col_mask")
        stored = (self.spec.in_dtypes[self.spec.loads[ja].input], self.spec.in_dtypes[self.spec.loads[jb].input])
        scope.add_all(k_loop(name, "(ROWS, BLOCK_SIZE)", operand, size, "ks", left, right, tile.precision, stored))
        self.types[name] = accumulator(operand)

    def _operand_offset(self, j: int, idx: list[str]) -> str:
        """A contraction operand's offset at index vectors ``idx`` (aligned to its trailing dims): a
        block of the tile's shape even where the operand does not vary along one of the tile's two
        dims (one element, ``[1, 1]``, or a stride-0 expanded matrix: its batch terms are scalars),
        as its mask is one."""
        classes = self.spec.loads[j].rows
        terms = offset_terms(self.load_names[j], classes, idx[len(idx) - len(classes) :])
        pads = [f"{i} * 0" for i in idx[-2:] if not any(i in t for t in terms)]
        return " + ".join(terms + pads)

    # ---- stores -----------------------------------------------------------------------
    def _store(self, k: int, loop: Scope) -> str:
        o = self.spec.outputs[k]
        v = self.value((Src.NODE, o.node), loop)
        val = self.storage(v, o.dtype)
        full = o.role is Role.FULL
        if not self.row:
            return f"tl.store({output_ptr(k)} + offs, {val}, mask=mask)"
        assert self.spec.domain is not None
        index = self._domain(full)
        terms = offset_terms(output_name(k), o.rows, index)
        walked = [red for cls, idx, red in zip(o.rows, index, self.spec.domain) if cls != BCAST and idx != "0"]
        on_rows, on_cols = any(not red for red in walked), any(walked)
        if not on_rows:
            terms.append("rows * 0")
        if full and not on_cols:
            terms.append("cols * 0")
        mask = "mask" if full else self.row_store_mask
        return f"tl.store({output_ptr(k)} + {' + '.join(terms)}, {val}, mask={mask})"

    def _begin(self, flat: str, prefix: str, size: str) -> None:
        self.named: set[tuple] = set()
        super()._begin(flat, prefix, size)
        # a product's right operand with batch dims: the program's batch coordinates (BATCH_ROWS)
        batch = self.spec.gemm.batch if self.spec.gemm is not None else 0
        self.rbatch = self._decompose(self.top, "batch", "rb", "rsize", batch)
