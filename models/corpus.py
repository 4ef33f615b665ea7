"""A small built-in English text (written for this project) on which the checkpoint tokenizer is
trained, so that making a checkpoint never needs the network."""

CORPUS = """\
A serving engine for language models spends its life in a loop. It takes the requests that are
waiting, decides which of them fit in the next step, runs the model once over all of them, and
hands each request the token it produced. Then it does the same thing again, thousands of times a
second, until every request has finished.

The first decision is about memory. Every token a request has seen leaves behind a key and a value
in every layer of the model, and those vectors must stay on the device for as long as the request
runs. The engine cuts that memory into blocks of equal size. A request owns a list of blocks, its
block table, and a new block is taken from the free pool only when the last one is full. Because
blocks are small, almost nothing is wasted, and because any block can hold any request's tokens,
the memory never needs to be compacted.

The second decision is about sharing. Two requests that begin with the same system prompt compute
the same keys and values for that prefix. If the engine remembers a hash for every full block, a
new request can look up its own prefix block by block and reuse what is already there. The hash of
a block covers its tokens and the hash of the block before it, so equal hashes mean equal
prefixes. A block that nobody uses any more keeps its hash until the pool runs short, and then it
is evicted and its memory is reused.

The third decision is about scheduling. Prefill processes a whole prompt at once and is limited by
arithmetic; decode processes one token per request and is limited by how fast the weights and the
cache can be read. A scheduler that batches many decode steps together keeps the device busy. When
memory runs out, a running request may be preempted: its blocks are freed and it waits to be
computed again from the start. Long prompts can be split into chunks so that a single request does
not stall everybody else for a long time.

The fourth decision is about time on the host. A small model on a fast device finishes a decode
step in a few milliseconds, so every microsecond of Python in the loop shows up in the throughput.
Recording the step as a graph and replaying it removes most of the launch overhead, but only for
shapes that were captured in advance; a batch of seven requests is padded to eight.

Good tools make these decisions visible. A counter tells you how many requests are waiting and how
many are running. A histogram tells you how long people waited for their first token: the median,
the ninety-fifth percentile and the worst case are different stories. A trace shows one request
from its arrival to its last token, with every preemption and every scheduled step marked on it.
A dashboard puts all of this on one screen and updates it while the engine runs.

Numbers matter as well as words: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 16, 32, 64, 128, 256, 512, 1024,
2048, 4096 and 8192 are the sizes that appear again and again. A step that took 12.5 ms at a batch
of 64 and 3.1 ms at a batch of 1 tells you where the time goes. Prices, dates and versions look
like $3.50, 2025-01-31, 10:45 and v0.2.1; percentages like 95% or 99.9%; ranges like 100-1024.

def schedule(waiting, running, free_blocks):
    batch = []
    for request in list(waiting):
        if request.num_blocks > free_blocks:
            break
        free_blocks -= request.num_blocks
        batch.append(request)
    return batch

if __name__ == "__main__":
    print("hello, world!")  # a comment; "quotes", 'single', (parens), [brackets] and {braces}

Questions people ask about such an engine: Why did my request wait so long? Why is the cache
almost full when only a few requests are running? What happens when two users send the same long
document? How many tokens per second can one card produce, and what limits it? Each answer is a
measurement, and each measurement is only as good as the events behind it.

The weather was mild on the morning the team met. Somebody brought coffee, somebody else brought a
whiteboard marker that still worked, and by noon there was a plan: write the engine small, make
every decision an event, and never trust a number that nobody can reproduce. The plan was simple,
but simple plans are the ones that survive contact with real hardware.
"""
