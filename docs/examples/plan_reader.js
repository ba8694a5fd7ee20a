#!/usr/bin/env node
// Read an octopipe Plan (binary protobuf, octopipe.plan.v1.Plan) without octopipe, protoc or any
// package: a small protobuf wire-format decoder and the Plan's field numbers from
// protos/octopipe/plan/v1/plan.proto. Prints the plan's stages, ranks and every rank's actions
// in the torch.distributed.pipelining text form (2F0, 1I3, 0W3, 0SEND_F1, (0F3;3B1)OVERLAP_F_B).
//
//   node docs/examples/plan_reader.js out/demo/plan.binpb
//
// Node.js 18 or later. See docs/plan-format.md.
"use strict";

const fs = require("node:fs");

// ---- protobuf wire format ------------------------------------------------------------------
// A message is a sequence of (tag, value); tag = field_number << 3 | wire_type.
// Wire types: 0 varint, 1 fixed 64-bit, 2 length-delimited (strings, bytes, messages, packed
// repeated scalars), 5 fixed 32-bit. Unknown fields are skipped, as every reader must.

function readVarint(buf, pos) {
  let result = 0n;
  let shift = 0n;
  for (;;) {
    if (pos >= buf.length) throw new Error("truncated varint");
    const byte = buf[pos++];
    result |= BigInt(byte & 0x7f) << shift;
    if ((byte & 0x80) === 0) return [result, pos];
    shift += 7n;
    if (shift > 63n) throw new Error("varint longer than 64 bits");
  }
}

// Every field of one message: [{field, wire, value}], value a BigInt (varint) or a Buffer.
function fields(buf) {
  const out = [];
  let pos = 0;
  while (pos < buf.length) {
    let tag;
    [tag, pos] = readVarint(buf, pos);
    const field = Number(tag >> 3n);
    const wire = Number(tag & 7n);
    if (wire === 0) {
      let value;
      [value, pos] = readVarint(buf, pos);
      out.push({ field, wire, value });
    } else if (wire === 2) {
      let length;
      [length, pos] = readVarint(buf, pos);
      const end = pos + Number(length);
      if (end > buf.length) throw new Error(`field ${field}: length ${length} runs past the end`);
      out.push({ field, wire, value: buf.subarray(pos, end) });
      pos = end;
    } else if (wire === 1) {
      pos += 8;
    } else if (wire === 5) {
      pos += 4;
    } else {
      throw new Error(`field ${field}: unsupported wire type ${wire}`);
    }
  }
  return out;
}

// A repeated uint32 field: packed (wire type 2) or one varint per element (wire type 0).
function uint32s(entries) {
  const values = [];
  for (const { wire, value } of entries) {
    if (wire === 0) {
      values.push(Number(value));
    } else {
      let pos = 0;
      while (pos < value.length) {
        let v;
        [v, pos] = readVarint(value, pos);
        values.push(Number(v));
      }
    }
  }
  return values;
}

// ---- octopipe.plan.v1 messages (field numbers from plan.proto) ----------------------------

const KIND_CODES = {
  1: "F", // ACTION_KIND_FORWARD
  2: "I", // ACTION_KIND_BACKWARD_INPUT
  3: "W", // ACTION_KIND_BACKWARD_WEIGHT
  4: "B", // ACTION_KIND_FULL_BACKWARD
  5: "OVERLAP_F_B",
  6: "SEND_F",
  7: "RECV_F",
  8: "SEND_B",
  9: "RECV_B",
  10: "UNSHARD",
  11: "RESHARD",
  12: "REDUCE_GRAD",
};

function decodeAction(buf) {
  const action = { kind: 0, stage: 0, microbatch: null, subActions: [] };
  for (const { field, value } of fields(buf)) {
    if (field === 1) action.kind = Number(value);
    else if (field === 2) action.stage = Number(value);
    else if (field === 3) action.microbatch = Number(value);
    else if (field === 4) action.subActions.push(decodeAction(value));
  }
  return action;
}

function actionText(action) {
  const code = KIND_CODES[action.kind];
  if (code === undefined) throw new Error(`unknown action kind ${action.kind}`);
  if (code === "OVERLAP_F_B") return `(${action.subActions.map(actionText).join(";")})OVERLAP_F_B`;
  return `${action.stage}${code}${action.microbatch === null ? "" : action.microbatch}`;
}

function decodeMapEntry(buf) {
  let key = "";
  let value = "";
  for (const f of fields(buf)) {
    if (f.field === 1) key = f.value.toString("utf8");
    else if (f.field === 2) value = f.value.toString("utf8");
  }
  return [key, value];
}

function decodePlan(buf) {
  const plan = {
    name: "", version: 0n, model: { name: "", source: "", config: {} }, stages: [],
    numMicrobatches: 0, ranks: [], labels: {}, mesh: null,
  };
  for (const { field, value } of fields(buf)) {
    if (field === 1) plan.name = value.toString("utf8");
    else if (field === 2) plan.version = value;
    else if (field === 3) {
      for (const f of fields(value)) {
        if (f.field === 1) plan.model.name = f.value.toString("utf8");
        else if (f.field === 2) plan.model.source = f.value.toString("utf8");
        else if (f.field === 3) {
          const [k, v] = decodeMapEntry(f.value);
          plan.model.config[k] = v;
        }
      }
    } else if (field === 4) {
      const stage = { index: 0, layers: [], rank: 0 };
      for (const f of fields(value)) {
        if (f.field === 1) stage.index = Number(f.value);
        else if (f.field === 2) stage.layers.push(f.value.toString("utf8"));
        else if (f.field === 3) stage.rank = Number(f.value);
      }
      plan.stages.push(stage);
    } else if (field === 5) plan.numMicrobatches = Number(value);
    else if (field === 6) {
      const rank = { rank: 0, memoryCapBytes: null, actions: [] };
      for (const f of fields(value)) {
        if (f.field === 1) rank.rank = Number(f.value);
        else if (f.field === 2) rank.memoryCapBytes = f.value;
        else if (f.field === 3) rank.actions.push(decodeAction(f.value));
      }
      plan.ranks.push(rank);
    } else if (field === 7) {
      const [k, v] = decodeMapEntry(value);
      plan.labels[k] = v;
    } else if (field === 8) {
      const entries = fields(value);
      const one = (n) => entries.filter((f) => f.field === n);
      plan.mesh = {
        dp: Number(one(1).at(-1)?.value ?? 0n),
        ep: Number(one(2).at(-1)?.value ?? 0n),
        globalRanks: uint32s(one(3)),
      };
    }
  }
  return plan;
}

// ---- the summary (tests/execute/test_plan_reader.py prints the same from Python) -----------

function summary(plan) {
  const lines = [];
  lines.push(`plan ${plan.name} version ${plan.version}: ${plan.numMicrobatches} micro-batches, ` +
    `${plan.stages.length} stages on ${plan.ranks.length} ranks`);
  lines.push(`model ${plan.model.name} from ${plan.model.source}`);
  for (const stage of plan.stages) {
    lines.push(`stage ${stage.index} on rank ${stage.rank}: ${stage.layers.join(" ")}`);
  }
  for (const rank of plan.ranks) {
    const cap = rank.memoryCapBytes === null ? "no cap" : `cap ${rank.memoryCapBytes} bytes`;
    lines.push(`rank ${rank.rank} (${cap}, ${rank.actions.length} actions): ${rank.actions.map(actionText).join(" ")}`);
  }
  if (plan.mesh !== null) {
    lines.push(`mesh dp ${plan.mesh.dp} ep ${plan.mesh.ep} global ranks [${plan.mesh.globalRanks.join(", ")}]`);
  }
  return lines.join("\n") + "\n";
}

function main(argv) {
  if (argv.length !== 1) {
    process.stderr.write("usage: node plan_reader.js PLAN.binpb (a binary octopipe.plan.v1.Plan)\n");
    return 2;
  }
  let data;
  try {
    data = fs.readFileSync(argv[0]);
  } catch (err) {
    process.stderr.write(`plan_reader: cannot read ${argv[0]}: ${err.code}\n`);
    return 2;
  }
  try {
    process.stdout.write(summary(decodePlan(data)));
  } catch (err) {
    process.stderr.write(`plan_reader: ${argv[0]} is not a binary Plan: ${err.message}\n`);
    return 2;
  }
  return 0;
}

if (require.main === module) process.exitCode = main(process.argv.slice(2));

module.exports = { decodePlan, summary, actionText };
