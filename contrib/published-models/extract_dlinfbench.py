"""Build tests/fixtures/published/memory_by_gpu.csv from DLInfBench's per-GPU results.

Source: nicklhy/DLInfBench (Apache-2.0), commit a626be297b20db165f439beb3ce6cb656313f081. Each file
``results/<gpu>/mxnet_<net>_float32_<batch>.txt`` holds one line, ``mxnet <net> float32 <batch>
<images/s> <MiB>`` (the two GTX 1080 folders, measured before the dtype was named: ``mxnet_<net>_<batch>.txt``,
``mxnet <net> <batch> <images/s> <MiB>``, fp32 then): MXNet fp32 inference of an ImageNet CNN, the MiB the process used by
``nvidia-smi`` (CUDA context, cuDNN workspace and MXNet's pool included). Six GPUs of three
generations, each with the CUDA its RESULT_*.md names. Only MXNet is kept: its one version line
runs on every GPU (the repository's PyTorch rows mix 0.1 on Pascal with 0.4-1.1 on later cards,
its TensorFlow rows show the allocator's growth, its Caffe rows lack the RTX 2080 Ti).
Usage: python extract_dlinfbench.py RESULTS_DIR > memory_by_gpu.csv
"""

import csv
import sys
from pathlib import Path

# The card each results folder measured and its CUDA (the repository's RESULT_*.md).
GPUS = {"gtx_1080": ("GeForce GTX 1080", "8.0.27"), "gtx_1080_ti": ("GeForce GTX 1080 Ti", "8.0.61"),
        "titan_x_pascal": ("Titan X (Pascal)", "8.0.61"), "titan_v": ("Titan V", "9.2.148"),
        "tesla_v100": ("Tesla V100-PCIE", "9.1.85"), "rtx2080ti": ("RTX2080Ti", "10.0.130")}
IMAGE = {"inception-v3": 299}  # inference_mxnet.py: 299 px for Inception-v3, else 224


def main(results: str) -> None:
    out = csv.writer(sys.stdout, lineterminator="\n")
    out.writerow(["source", "framework", "model", "batch_size", "image_size", "precision", "gpu_dir", "gpu",
                  "cuda", "peak_mib", "measure"])
    rows = []
    for path in sorted(Path(results).glob("*/mxnet_*.txt")):
        words = path.read_text().split()
        if len(words) == 5:  # before the dtype was named
            words.insert(2, "float32")
        framework, net, dtype, batch, _, mib = words
        if dtype != "float32":
            continue
        gpu, cuda = GPUS[path.parent.name]
        rows.append(["dlinfbench", framework, net, int(batch), IMAGE.get(net, 224), dtype, path.parent.name, gpu,
                     cuda, int(mib), "nvidia_smi_process_used"])
    out.writerows(sorted(rows, key=lambda r: (r[2], r[3], r[6])))


if __name__ == "__main__":
    main(sys.argv[1])
