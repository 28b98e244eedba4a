"""What every run learns, readable without torch (the runner's planning reads it): the labels of the
Weibo emotion data, and the architecture of the real model, which --model base-shape builds."""
from pathlib import Path

from .files import read_json_object

LABELS = ["其他", "喜好", "悲伤", "厌恶", "愤怒", "高兴"]
BASE_SHAPE_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "models" / "chinese-bert-wwm-ext.json"


def base_shape_config():
    """The architecture values of hfl/chinese-bert-wwm-ext's published config.json."""
    return read_json_object(BASE_SHAPE_CONFIG, "model config")["config"]
