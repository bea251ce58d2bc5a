"""The KV pool as a block map: which request owned each physical block, step by step.

    from tinyserve.trace_reading import load_run, plots_blocks
    plots_blocks.plot_block_map(load_run("traces/my-run"))

Rows are the pool's blocks, columns the engine's steps, a cell's colour the request
whose block table held the block at that step (white: free, or holding only a cached
prefix), each request its own colour however many there are. A block in more than one table at once, a prefix shared through the prefix
cache, is grey with a dot. A block that holds an image's placeholder tokens (a prompt with images:
its render span logs each image's placeholder run) has a cross. Read from the step spans'
block-table changes (Run.block_tables); runs recorded before steps logged them cannot be drawn.
"""

import numpy as np
from matplotlib.colors import ListedColormap, hsv_to_rgb
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from tinyserve.trace_reading.plots import PALETTE
from tinyserve.trace_reading.run import Run

_MAX_LEGEND_REQUESTS = 12


def request_colors(count: int) -> list:
    """`count` colours, all different: the palette's while it lasts, then hues spaced evenly around the
    colour wheel (grey and white stay the shared and free blocks'), so no two requests look alike."""
    if count <= len(PALETTE):
        return PALETTE[:count]
    return [hsv_to_rgb((k / count, 0.65 if k % 2 else 0.9, 0.95 if k % 2 else 0.7)) for k in range(count)]


def placeholder_runs(run: Run) -> dict[str, list[tuple[int, int]]]:
    """Engine request id -> its images' placeholder runs (offset, length), as the request's inputs logged them."""
    return {sequence.request_id: request.inputs.mm_placeholders for request in run.requests
            if request.inputs.mm_placeholders for sequence in request.sequences}


def image_blocks(block_ids: list[int], runs: list[tuple[int, int]], block_size: int) -> list[int]:
    """The blocks of a block table whose tokens include an image's placeholders."""
    return [block for index, block in enumerate(block_ids)
            if any(offset < (index + 1) * block_size and index * block_size < offset + length
                   for offset, length in runs)]


def plot_block_map(run: Run, engine_index: int = 0) -> Figure:
    """Blocks × steps of one engine, coloured by owning request, shared prefix blocks dotted."""
    by_step = run.block_tables(engine_index)
    step_ids = sorted(by_step)
    steps = {s.step_id: s for s in run.engine_steps(engine_index)}
    num_blocks = max((steps[i].kv_blocks_total or 0 for i in step_ids), default=0)
    num_blocks = max([num_blocks, *(b + 1 for tables in by_step.values() for ids in tables.values() for b in ids)])
    owners = list(dict.fromkeys(r for i in step_ids for r in by_step[i]))  # by first appearance
    owner_index = {request_id: k for k, request_id in enumerate(owners)}
    free, shared = -1, -2
    grid = np.full((num_blocks, len(step_ids)), free, dtype=int)
    shared_x, shared_y, image_x, image_y = [], [], [], []
    images, block_size = placeholder_runs(run), run.manifest.get("engine_args", {}).get("block_size", 16)
    for column, step_id in enumerate(step_ids):
        holders: dict[int, int] = {}
        for request_id, block_ids in by_step[step_id].items():
            crossed = image_blocks(block_ids, images.get(request_id, []), block_size)
            image_x += [column] * len(crossed)
            image_y += crossed
            for block in block_ids:
                holders[block] = holders.get(block, 0) + 1
                grid[block, column] = owner_index[request_id] if holders[block] == 1 else shared
        for block, count in holders.items():
            if count > 1:
                shared_x.append(column)
                shared_y.append(block)
    colors = ["tab:gray", "white"] + request_colors(len(owners))
    fig = Figure(figsize=(min(4 + 0.12 * len(step_ids), 18), min(2 + 0.22 * num_blocks, 12)), layout="constrained")
    ax = fig.add_subplot()
    ax.imshow(grid + 2, cmap=ListedColormap(colors), vmin=0, vmax=len(colors) - 1, aspect="auto",
              interpolation="nearest", origin="lower",
              extent=(-0.5, len(step_ids) - 0.5, -0.5, num_blocks - 0.5))
    if shared_x:
        ax.scatter(shared_x, shared_y, s=12, c="black", marker="o", label="shared prefix block (grey)")
    if image_x:
        ax.scatter(image_x, image_y, s=10, c="black", marker="x", linewidths=0.6, label="image placeholders")
    ticks = np.linspace(0, len(step_ids) - 1, num=min(len(step_ids), 10), dtype=int) if step_ids else []
    ax.set_xticks(ticks, [str(step_ids[t]) for t in ticks])
    ax.set(xlabel="engine step", ylabel="physical KV block",
           title=f"KV blocks by owning request, engine {engine_index} ({len(owners)} requests)")
    handles = [Patch(color=colors[k + 2], label=owners[k][-12:]) for k in range(min(len(owners), _MAX_LEGEND_REQUESTS))]
    handles += [c for c in ax.collections if c.get_label() in ("shared prefix block (grey)", "image placeholders")]
    if handles:
        fig.legend(handles=handles, loc="outside right upper", fontsize="small", title="request")
    return fig
