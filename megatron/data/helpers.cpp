// Index builders for the GPT dataset, in C++ because they walk every document of a
// corpus (millions of documents, billions of tokens) one step at a time, which is far too
// slow as a Python loop and does not vectorize in numpy.
//
// build_sample_idx: where each training sample starts in the shuffled document order.
// build_blending_indices: which dataset (and which of its samples) feeds each blended sample.

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace py = pybind11;

namespace {

using IntArray = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;
using FloatArray = py::array_t<double, py::array::c_style | py::array::forcecast>;

// Samples are seq_length + 1 tokens long (inputs plus the shifted labels) and consecutive
// samples share one token: sample k covers tokens [k * seq_length, (k + 1) * seq_length]
// of the concatenation of the documents listed in doc_idx. Row k of the result is
// (position in doc_idx, token offset inside that document) of the first token of sample k;
// row k + 1 therefore also locates sample k's last token. The result has
// num_samples + 1 rows, num_samples = (num_epochs * tokens_per_epoch - 1) / seq_length.
py::array_t<int64_t> build_sample_idx(const IntArray& sizes_in, const IntArray& doc_idx_in,
                                      int64_t seq_length, int64_t num_epochs,
                                      int64_t tokens_per_epoch) {
  if (seq_length <= 0) throw std::invalid_argument("seq_length must be positive");
  if (num_epochs <= 0) throw std::invalid_argument("num_epochs must be positive");
  if (tokens_per_epoch <= seq_length)
    throw std::invalid_argument("tokens_per_epoch must exceed seq_length");
  auto sizes = sizes_in.unchecked<1>();
  auto doc_idx = doc_idx_in.unchecked<1>();
  const int64_t num_docs = doc_idx.shape(0);
  const int64_t num_samples = (num_epochs * tokens_per_epoch - 1) / seq_length;

  py::array_t<int64_t> result({num_samples + 1, int64_t{2}});
  auto out = result.mutable_unchecked<2>();
  {
    py::gil_scoped_release no_gil;  // pure C++ from here: let other Python threads run
    int64_t position = 0;           // index into doc_idx
    int64_t offset = 0;             // token offset inside document doc_idx[position]
    out(0, 0) = 0;
    out(0, 1) = 0;
    for (int64_t sample = 1; sample <= num_samples; ++sample) {
      // Advance seq_length tokens: the next sample starts on this sample's last token.
      int64_t remaining = seq_length;
      while (true) {
        if (position >= num_docs)
          throw std::runtime_error("doc_idx holds fewer tokens than num_epochs * tokens_per_epoch");
        const int64_t doc = doc_idx(position);
        if (doc < 0 || doc >= sizes.shape(0))
          throw std::out_of_range("doc_idx entry " + std::to_string(doc) + " is not a valid document");
        const int64_t left_in_doc = sizes(doc) - offset;
        // Stop inside this document; a start on its last token is fine (the sample then
        // continues into the next document).
        if (remaining < left_in_doc) {
          offset += remaining;
          break;
        }
        remaining -= left_in_doc;
        ++position;
        offset = 0;
      }
      out(sample, 0) = position;
      out(sample, 1) = offset;
    }
  }
  return result;
}

// Blended sample i comes from the dataset that is furthest behind its share so far
// (largest weights[d] * (i + 1) - taken[d]; ties go to the lower index), so every prefix
// of the blended order matches the weights as closely as whole samples allow.
// Returns (dataset index, sample index within that dataset) per blended sample.
py::tuple build_blending_indices(const FloatArray& weights_in, int64_t size) {
  if (size < 0) throw std::invalid_argument("size must be non-negative");
  auto weights = weights_in.unchecked<1>();
  const int64_t num_datasets = weights.shape(0);
  if (num_datasets <= 0) throw std::invalid_argument("weights must not be empty");

  py::array_t<int64_t> dataset_index(size);
  py::array_t<int64_t> dataset_sample_index(size);
  auto which = dataset_index.mutable_unchecked<1>();
  auto sample = dataset_sample_index.mutable_unchecked<1>();
  {
    py::gil_scoped_release no_gil;
    std::vector<int64_t> taken(num_datasets, 0);
    for (int64_t i = 0; i < size; ++i) {
      const double target = static_cast<double>(i + 1);
      int64_t best = 0;
      double best_error = weights(0) * target - static_cast<double>(taken[0]);
      for (int64_t d = 1; d < num_datasets; ++d) {
        const double error = weights(d) * target - static_cast<double>(taken[d]);
        if (error > best_error) {
          best_error = error;
          best = d;
        }
      }
      which(i) = best;
      sample(i) = taken[best];
      ++taken[best];
    }
  }
  return py::make_tuple(dataset_index, dataset_sample_index);
}

}  // namespace

PYBIND11_MODULE(helpers, m) {
  m.doc() = "C++ index builders for megatron.data.gpt_dataset and blendable_dataset";
  m.def("build_sample_idx", &build_sample_idx, py::arg("sizes"), py::arg("doc_idx"),
        py::arg("seq_length"), py::arg("num_epochs"), py::arg("tokens_per_epoch"),
        "Per sample (position in doc_idx, offset in that document) of its first token; "
        "num_samples + 1 rows of int64.");
  m.def("build_blending_indices", &build_blending_indices, py::arg("weights"), py::arg("size"),
        "Greedy blending order: (dataset index, sample index within it) per blended sample.");
}
