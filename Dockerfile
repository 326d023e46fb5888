# vmmd in a container. Build: docker build -t vmmd .
# Run (host backend):  docker run --rm -v /run/vmmd:/run/vmmd vmmd
# Run (GPU, once the cuda backend lands): add --gpus all
# Clients in other containers mount the same /run/vmmd and set VMMD_SOCKET_DIR=/run/vmmd.

FROM node:20-bookworm AS build
WORKDIR /app
COPY package.json package-lock.json binding.gyp tsconfig.json ./
COPY scripts scripts
COPY proto proto
COPY native native
COPY common common
COPY server server
COPY client client
COPY test test
COPY bin bin
# npm ci builds the addon (node-gyp) and the TypeScript (prepare).
RUN npm ci && npm prune --omit=dev

FROM node:20-bookworm-slim
ENV NODE_ENV=production NVIDIA_DRIVER_CAPABILITIES=compute,utility
WORKDIR /app
COPY --from=build /app/package.json ./
COPY --from=build /app/node_modules node_modules
COPY --from=build /app/build/Release/vmmd_native.node build/Release/vmmd_native.node
COPY --from=build /app/dist dist
COPY --from=build /app/proto proto
COPY --from=build /app/bin bin
VOLUME /run/vmmd
ENTRYPOINT ["node", "bin/vmmd.js", "--socket-dir", "/run/vmmd"]
