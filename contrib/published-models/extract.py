"""Build slurmgpu/pipeline/model_sizes.csv from timm's published inference benchmark.

Source: huggingface/pytorch-image-models, results/benchmark-infer-amp-nchw-pt240-cu124-rtx4090.csv
(last changed in commit 5c33776aa59f0f05bfb8008ff546ed4c09083f1a). Columns used: ``model``,
``infer_img_size``, ``param_count`` (millions of parameters) and ``infer_macts`` (millions of
activations per image in a forward pass, counted by timm's profiler at that image size).

A model benchmarked at several image sizes keeps the smallest size of at least 224 pixels (the
usual training size), else its largest. Usage: python extract.py BENCHMARK.csv > model_sizes.csv
"""

import csv
import sys


def main(path: str) -> None:
    best: dict[str, dict[str, str]] = {}
    with open(path, newline="") as fh:
        for row in csv.DictReader(fh):
            size, kept = int(row["infer_img_size"]), best.get(row["model"])
            if kept is None:
                best[row["model"]] = row
                continue
            old = int(kept["infer_img_size"])
            if (old < 224 <= size) or (size >= 224 and size < old) or (old < 224 and size > old):
                best[row["model"]] = row
    out = csv.writer(sys.stdout, lineterminator="\n")
    out.writerow(["model", "img_size", "params_m", "acts_m"])
    for name in sorted(best):
        row = best[name]
        out.writerow([name, row["infer_img_size"], row["param_count"], row["infer_macts"]])


if __name__ == "__main__":
    main(sys.argv[1])
