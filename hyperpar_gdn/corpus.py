"""The built-in training text: a few kilobytes of plain English, so the default run needs no
download and no file. A byte-level model learns its letters, words and phrases within a minute
on a CPU, so the loss falls clearly (from ln 256 = 5.55 nats per byte)."""

from __future__ import annotations

BUILTIN_CORPUS = """\
The river runs past the mill and under the old stone bridge. In the morning the water is grey,
at noon it is green, and in the evening it shines like copper. The miller opens the gate at
dawn, the wheel begins to turn, and the stones begin to grind the grain into flour.

The baker buys the flour from the miller. She carries it home in a cart, she mixes it with
water and salt, and she leaves the dough to rise under a clean white cloth. When the dough has
risen she shapes the loaves, she bakes them in a hot oven, and she sells the bread in the market.

The market opens on the first day of the week. The farmer brings eggs and cheese, the fisher
brings fish from the lake, and the weaver brings cloth of every colour. The children run
between the stalls, the dogs sleep in the shade, and the old men talk about the weather.

A model reads a text one byte at a time. At first it knows nothing, and every byte looks as
likely as every other byte. Then it learns that spaces follow words, that a capital letter
follows a full stop, and that the letter q is followed by the letter u. Later it learns whole
words, and at last it learns phrases that come back again and again in the same text.

A gated delta rule keeps a small memory of what it has read. At every step it forgets a little,
it removes the old value that was stored under the current key, and it writes the new value in
its place. The memory has a fixed size, so the cost of reading a long text grows only linearly
with its length. Every fourth layer of the model uses softmax attention instead, which looks
back at every earlier token and finds the exact one it needs.

When a text is too long for one device, each device takes one piece of the sequence. The first
device holds the beginning, the last device holds the end, and the devices pass to each other
what the later pieces need to know about the earlier ones. The result is the same as if one
device had read the whole text, only faster and with less memory on each device.

The river runs past the mill and under the old stone bridge. The miller opens the gate at dawn,
the baker bakes the bread, and the market opens on the first day of the week. The model reads
the text one byte at a time, and little by little it learns to guess the next byte.

One, two, three, four, five, six, seven, eight, nine, ten. Ten, nine, eight, seven, six, five,
four, three, two, one. Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday. January,
February, March, April, May, June, July, August, September, October, November, December.
Spring, summer, autumn, winter. North, east, south, west. Red, orange, yellow, green, blue,
indigo, violet. The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the
lazy dog again, and the lazy dog does not wake up.

In the winter the river freezes, the wheel stops, and the miller mends the gate. The baker
bakes less bread, the market is quiet, and the children skate on the ice. In the spring the
ice breaks, the water rises, and the wheel begins to turn again. The year goes round like the
wheel, and the river runs on past the mill and under the old stone bridge.
"""
