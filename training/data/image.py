"""Image columns of Parquet data (the driver resolves the settings; the workers decode): a column of
encoded images (PNG, JPEG, any format Pillow reads; or Hugging Face datasets' {bytes, path}
structs) decoded a row group at a time where the row group is read (the workers' read threads; the
driver only for the first row group, its check), then resized and normalized by a `transformers`
image processor into the `image_classification` task's `pixel_values` (float32, [rows, C, H, W]).

The processor's settings are resolved once, on the driver (`resolve`): a pretrained model's own
preprocessor_config.json (`image_processor: {from_model: true}`), or the ViT processor's defaults,
with the options given on top. The resolved settings travel in the data's spec (`image_processor`):
the workers build the same processor from them without reading the model's folder, the dataset key
changes when they change, and the exported model folder saves them as its preprocessor_config.json,
so that `AutoImageProcessor.from_pretrained` prepares an image as training did.

Processors run on their PIL backend everywhere: the torchvision one (the default where torchvision
is installed) resizes with other filters, and training would then see other pixels than the export.
"""

from __future__ import annotations

import functools
import io
import json
from typing import Literal, Optional, Union

import numpy as np
import pyarrow as pa

from training import storage
from training.data.parquet_checks import ColumnError
from training.errors import UserError, first_line
from training.schema import Section

OPTION = "data.options.image_processor"
IMAGE_OPTION = "data.options.image"
PROCESSOR_FILE = "preprocessor_config.json"
DEFAULT_PROCESSOR = "ViTImageProcessor"  # (resize to size, rescale to [0, 1], normalize: nothing else)
# PIL's resampling filters by name (PIL.Image.Resampling's values, as preprocessor_config.json writes them).
RESAMPLE = {"nearest": 0, "lanczos": 1, "bilinear": 2, "bicubic": 3, "box": 4, "hamming": 5}
MODES = {1: "L", 3: "RGB"}


class ImageProcessorOptions(Section):
    # The settings of the pretrained model's image processor (model.name hf, its
    # model.options.pretrained folder's preprocessor_config.json); else the ViT processor's defaults
    # (224 x 224, bilinear, mean and std 0.5). The options below override either.
    from_model: bool = False
    # Resize to size x size pixels (an int) or {height, width} (or any size a preprocessor_config.json holds).
    size: Optional[Union[int, dict[str, int]]] = None
    resample: Optional[Literal["nearest", "bilinear", "bicubic", "lanczos", "box", "hamming"]] = None
    do_resize: Optional[bool] = None
    do_normalize: Optional[bool] = None
    # Per channel, after pixels are scaled to [0, 1].
    image_mean: Optional[list[float]] = None
    image_std: Optional[list[float]] = None
    # Each image is converted to RGB (3) or grayscale (1) first: the model's num_channels.
    channels: Literal[1, 3] = 3


def processor_class(name: str):
    """The PIL backend's class of a processor type (`ViTImageProcessor` -> ViTImageProcessorPil);
    the type itself where it has no PIL form."""
    from transformers.models.auto.image_processing_auto import get_image_processor_class_from_name  # (lazy)

    base = name.removesuffix("Fast")
    for candidate in (base + "Pil", base):
        found = get_image_processor_class_from_name(candidate)
        if found is not None and not getattr(found, "is_dummy", False):
            return found
    return None


@functools.lru_cache(maxsize=8)
def processor_of(settings_json: str):
    """The processor of resolved settings (JSON), built once per process and settings."""
    settings = json.loads(settings_json)
    return processor_class(settings["image_processor_type"]).from_dict(settings)


def folder_settings(folder: str) -> dict:
    """A pretrained folder's preprocessor_config.json (UserError naming the option)."""
    uri = storage.join(folder, PROCESSOR_FILE)
    try:
        if not storage.exists(uri):
            raise UserError(f"{OPTION}.from_model: model.options.pretrained {folder} has no {PROCESSOR_FILE} (the "
                            "image processor's settings, which save_pretrained of an image processor writes); give "
                            f"{OPTION}'s size, image_mean and image_std instead")
        body = json.loads(storage.read_text(uri))
    except OSError as exc:
        raise UserError(f"{OPTION}.from_model: {uri} cannot be read: {first_line(exc)}") from None
    except ValueError as exc:
        raise UserError(f"{OPTION}.from_model: {uri} is not JSON: {first_line(exc)}") from None
    if not isinstance(body, dict):
        raise UserError(f"{OPTION}.from_model: {uri} is not a JSON object")
    return body


def resolve_processor(options: ImageProcessorOptions, folder: Optional[str]) -> dict:
    """The processor's full settings (JSON-ready): the folder's (from_model) or the defaults, the
    options on top; UserError naming the option for settings no processor takes."""
    settings = folder_settings(folder) if options.from_model else {"image_processor_type": DEFAULT_PROCESSOR}
    given = options.model_dump(exclude={"from_model", "channels"}, exclude_none=True)
    if isinstance(given.get("size"), int):
        given["size"] = {"height": given["size"], "width": given["size"]}
    if "resample" in given:
        given["resample"] = RESAMPLE[given["resample"]]
    settings = {**settings, **given, "do_convert_rgb": options.channels == 3}
    settings.setdefault("image_processor_type", DEFAULT_PROCESSOR)
    settings.pop("processor_class", None)  # (a multimodal processor's, not the image processor's)
    if processor_class(settings["image_processor_type"]) is None:
        raise UserError(f"{OPTION}: image_processor_type {settings['image_processor_type']!r} is not an image "
                        "processor of transformers")
    try:
        processor = processor_class(settings["image_processor_type"]).from_dict(settings)
    except (ValueError, TypeError, KeyError) as exc:
        raise UserError(f"{OPTION}: {first_line(exc)}") from None
    resolved = json.loads(processor.to_json_string())
    for name in ("image_mean", "image_std"):
        value = resolved.get(name)
        if resolved.get("do_normalize") and isinstance(value, list) and len(value) != options.channels:
            if options.channels == 1 and len(set(value)) == 1 and name not in given:
                resolved[name] = value[:1]  # (the same value for every channel: one channel's)
            else:
                raise UserError(f"{OPTION}.{name}: {len(value)} values for images of {options.channels} channels "
                                f"({OPTION}.channels); give one per channel")
    return resolved


def image_values(column: pa.ChunkedArray) -> list:
    """The encoded images of a column: binary values, or the `bytes` of {bytes, path} structs."""
    if pa.types.is_struct(column.type):
        column = pa.chunked_array([chunk.field("bytes") for chunk in column.chunks], column.type.field("bytes").type)
    return column.to_pylist()


def decode(column: pa.ChunkedArray, name: str, settings_json: str, channels: int,
           shape: Optional[tuple[int, ...]] = None) -> np.ndarray:
    """A row group's images as the processor makes them: float32 [rows, channels, height, width].
    ColumnError (data.options.image) naming the row for bytes that are not an image, and for images
    that come out of another shape than `shape` (the first row group's: a batch stacks them)."""
    from PIL import Image  # (lazy: Pillow, only for image data)

    images = []
    for row, data in enumerate(image_values(column)):
        if data is None:
            raise ColumnError(f"column {name!r} row {row} holds no image (null bytes)", IMAGE_OPTION)
        try:
            with Image.open(io.BytesIO(data)) as image:
                image.load()
                images.append(image.convert(MODES[channels]))
        except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:  # (Pillow's own pixel limit)
            raise ColumnError(f"column {name!r} row {row} is not an image Pillow decodes ({len(data)} bytes): "
                              f"{first_line(exc, 120)}", IMAGE_OPTION) from None
    if not images:
        return np.zeros((0, *(shape or (channels, 0, 0))), np.float32)
    try:
        pixels = processor_of(settings_json)(images)["pixel_values"]
    except (ValueError, TypeError) as exc:
        raise ColumnError(f"column {name!r}: the image processor fails on these images: {first_line(exc, 160)}",
                          OPTION) from None
    first = shape or tuple(pixels[0].shape)
    other = next((row for row, p in enumerate(pixels) if tuple(p.shape) != first), None)
    if other is not None:
        raise ColumnError(f"column {name!r} row {other} comes out of the image processor as "
                          f"{list(pixels[other].shape)}, the data's images as {list(first)}: set {OPTION}.size "
                          "to a fixed {height, width} (a processor that keeps each image's aspect ratio makes "
                          "images no batch can stack)",
                          OPTION)
    return np.stack(pixels).astype(np.float32, copy=False)
