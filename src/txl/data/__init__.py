"""Datasets, tokenizers, cached ids and batch iterators (see the README's "Data" section)."""

from txl.data.corpus import Corpus, DataConfig, SentenceShard, cached_corpus, prepare_corpus
from txl.data.errors import DataError
from txl.data.iterators import Batch, OrderedIterator, SentenceStreamIterator
from txl.data.readers import Layout, find_splits
from txl.data.sources import DATASETS, get_dataset
from txl.data.text import FileRange
from txl.data.tokenizer import Tokenizer
